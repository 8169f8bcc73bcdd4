//! The ceiling of `writers8_vs_writers1` on this machine: a group commit
//! that does nothing but the disk's part (issue 14).
//!
//! [`BareLog`] is the store's group commit with every piece of store work
//! taken out: a writer appends the bytes a create puts in the journal
//! ([`CREATE_JOURNAL_BYTES`]) to a shared buffer and waits until a sync
//! covers them; the first writer to find no group running leads one. The
//! leader waits for the writers of the last group as the store's does
//! (at most half the last group's time, at most 500 µs; `kv/commit.rs`),
//! then writes the buffer into a file already written with zeros, as the
//! store's spare journal is, and `fdatasync`s it; the group's writers are
//! woken with one `notify_all` on the same kind of condition variable
//! (parking_lot's). No validation, no scrubbing, no encoding, no engine.
//!
//! Eight bare writers over one bare writer is then what a store whose
//! creates cost no CPU at all could reach with closed-loop writers (each
//! waits for its answer before its next create) on this disk and these
//! cores: the one-writer side pays one sync per create, the eight-writer
//! side one per group plus the wake-ups and context switches that eight
//! threads on two cores cost.

use std::fs::{File, OpenOptions};
use std::io::{Seek as _, SeekFrom, Write as _};
use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// What one create of the bench's record appends to the store's journal
/// (its run record, index entries and counters, with fjall's framing):
/// 897 B measured for one writer's creates, a batch each; a group of
/// eight shares one batch's framing and counters.
pub const CREATE_JOURNAL_BYTES: usize = 870;

/// The longest a bare leader waits for the last group's writers (the
/// store's `GATHER_MAX`).
const GATHER_MAX: Duration = Duration::from_micros(500);

struct State {
    /// Bytes queued for the next group, and how many appends they are.
    buf: Vec<u8>,
    queued: usize,
    /// Tickets handed out; every ticket below `synced` is durable.
    next: u64,
    synced: u64,
    leading: bool,
    last_group: usize,
    last_took: Duration,
    /// While a leader gathers: the queue length it waits for (0: none).
    gather_until: usize,
    groups: u64,
}

/// A log file shared by closed-loop writers through a bare group commit.
pub struct BareLog {
    state: Mutex<State>,
    answered: Condvar,
    arrived: Condvar,
    file: Mutex<File>,
}

/// A file of `bytes` written zeros, synced, its cursor at the start.
fn zeroed(path: &Path, bytes: usize) -> File {
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(path)
        .expect("bare log file");
    f.write_all(&vec![0u8; bytes]).expect("zero the bare log");
    f.sync_all().expect("sync the bare log");
    f.seek(SeekFrom::Start(0)).expect("rewind the bare log");
    f
}

impl BareLog {
    /// A log with room for `appends` creates' bytes.
    pub fn new(path: &Path, appends: usize) -> BareLog {
        BareLog {
            state: Mutex::new(State {
                buf: Vec::new(),
                queued: 0,
                next: 0,
                synced: 0,
                leading: false,
                last_group: 0,
                last_took: Duration::ZERO,
                gather_until: 0,
                groups: 0,
            }),
            answered: Condvar::new(),
            arrived: Condvar::new(),
            file: Mutex::new(zeroed(path, appends * CREATE_JOURNAL_BYTES)),
        }
    }

    /// Appends `rec` and returns once a sync covers it.
    pub fn append(&self, rec: &[u8]) {
        let mut g = self.state.lock();
        let me = g.next;
        g.next += 1;
        g.buf.extend_from_slice(rec);
        g.queued += 1;
        if g.gather_until != 0 && g.queued >= g.gather_until {
            self.arrived.notify_one();
        }
        loop {
            if g.synced > me {
                return;
            }
            if g.leading {
                self.answered.wait(&mut g);
                continue;
            }
            g.leading = true;
            let want = g.last_group;
            if g.queued < want && !g.last_took.is_zero() {
                g.gather_until = want;
                let window = (g.last_took / 2).min(GATHER_MAX);
                self.arrived.wait_for(&mut g, window);
                g.gather_until = 0;
            }
            let buf = std::mem::take(&mut g.buf);
            let n = std::mem::take(&mut g.queued);
            let upto = g.next;
            drop(g);
            let started = Instant::now();
            {
                let mut f = self.file.lock();
                f.write_all(&buf).expect("bare log write");
                f.sync_data().expect("bare log sync");
            }
            let took = started.elapsed();
            g = self.state.lock();
            // The buffer's allocation goes back for the next group.
            if g.buf.is_empty() {
                let mut buf = buf;
                buf.clear();
                g.buf = buf;
            }
            g.synced = upto;
            g.leading = false;
            g.last_group = n;
            g.last_took = took;
            g.groups += 1;
            self.answered.notify_all();
        }
    }
}

/// Ops per second of `writers` closed-loop writers, `per` appends each,
/// on a fresh bare log under `dir`; and the groups they made.
pub fn run(dir: &Path, writers: usize, per: usize) -> (f64, u64) {
    let log = Arc::new(BareLog::new(
        &dir.join(format!("bare{writers}.log")),
        writers * per,
    ));
    let barrier = Arc::new(Barrier::new(writers + 1));
    let handles: Vec<_> = (0..writers)
        .map(|_| {
            let (log, barrier) = (log.clone(), barrier.clone());
            std::thread::spawn(move || {
                let rec = [0x5au8; CREATE_JOURNAL_BYTES];
                barrier.wait();
                for _ in 0..per {
                    log.append(&rec);
                }
            })
        })
        .collect();
    barrier.wait();
    let t = Instant::now();
    for h in handles {
        h.join().expect("bare writer");
    }
    let secs = t.elapsed().as_secs_f64();
    let groups = log.state.lock().groups;
    ((writers * per) as f64 / secs, groups)
}
