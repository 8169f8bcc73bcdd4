//! Rule T7 under concurrency: `instance_trays` answers from one snapshot.
//!
//! A writer at epoch e applies batches that keep invariants across trays
//! on both ends of a large instance (an amount moved between `a/x` and
//! `z/x`, which are marked together; a token moved between `t/0` and
//! `t/1`; 1,500 trays in between, more than one page of `list_trays`)
//! while readers call `instance_trays` at e, with and without filters.
//! Every read must see every invariant whole: a read assembled from two
//! moments (say, one page before a batch and one after) sees an amount
//! that does not add up, two tokens or none.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use agentstate::{
    Alarm, IdempotencyKey, InstanceKey, MarkedTray, MemoryStore, Millis, Page, PageRequest, Result,
    StateError, Tray, TrayFilter, TrayKey, TrayOp, TrayStore,
};

const TOTAL: u64 = 100;
const FILLERS: usize = 1_500;
const EPOCH: u64 = 5;

fn tray(marked: bool, doc: impl Into<Vec<u8>>) -> Tray {
    Tray {
        marked,
        doc: doc.into(),
        env: "snap-env".into(),
        hostname: "host".into(),
    }
}

fn put(tray_ns: &str, tray_id: &str, t: Tray) -> TrayOp {
    TrayOp::Put {
        tray_ns: tray_ns.into(),
        tray_id: tray_id.into(),
        tray: t,
    }
}

/// A fresh instance name (the Redis server is shared with other tests).
fn fresh_instance() -> InstanceKey {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    InstanceKey::new(
        format!(
            "snap{:x}{:x}-{}",
            std::process::id(),
            nanos & 0xffff_ffff,
            NEXT.fetch_add(1, Ordering::Relaxed)
        ),
        "i",
    )
}

/// Batch `n` of the writer: `a/x` holds n % 101, `z/x` the rest of
/// `TOTAL`, both marked unless n is a multiple of 4; the token is in
/// `t/<n % 2>`.
fn batch(n: u64) -> Vec<TrayOp> {
    let x = n % (TOTAL + 1);
    let marked = !n.is_multiple_of(4);
    vec![
        put("a", "x", tray(marked, x.to_string())),
        TrayOp::Delete {
            tray_ns: "t".into(),
            tray_id: ((n + 1) % 2).to_string(),
        },
        put("t", &(n % 2).to_string(), tray(false, "token")),
        put("z", "x", tray(marked, (TOTAL - x).to_string())),
    ]
}

/// What is wrong with one read under `filter`, if anything.
fn violation(filter: &TrayFilter, got: &[(TrayKey, Tray)]) -> Option<String> {
    let find = |ns: &str, id: &str| {
        got.iter()
            .find(|(k, _)| k.tray_ns == ns && k.tray_id == id)
            .map(|(_, t)| t)
    };
    let amount = |t: &Tray| -> u64 { String::from_utf8_lossy(&t.doc).parse().unwrap_or(u64::MAX) };
    let mut sorted = got
        .iter()
        .map(|(k, _)| (&k.tray_ns, &k.tray_id))
        .collect::<Vec<_>>();
    sorted.sort();
    if !sorted
        .into_iter()
        .eq(got.iter().map(|(k, _)| (&k.tray_ns, &k.tray_id)))
    {
        return Some("not in (tray_ns, tray_id) order".into());
    }
    if got.iter().any(|(k, t)| !filter.matches(k, t)) {
        return Some("a tray the filter excludes".into());
    }
    match (find("a", "x"), find("z", "x")) {
        (Some(a), Some(z)) => {
            if amount(a).checked_add(amount(z)) != Some(TOTAL) {
                return Some(format!(
                    "a/x + z/x = {} + {}, not {TOTAL}",
                    amount(a),
                    amount(z)
                ));
            }
            if a.marked != z.marked {
                return Some("a/x and z/x disagree on marked".into());
            }
        }
        (None, None) if filter.marked.is_some() => {}
        (a, z) => {
            return Some(format!(
                "a/x present: {}, z/x present: {}",
                a.is_some(),
                z.is_some()
            ));
        }
    }
    let tokens = usize::from(find("t", "0").is_some()) + usize::from(find("t", "1").is_some());
    let want_tokens = usize::from(filter.marked != Some(true));
    if tokens != want_tokens {
        return Some(format!("{tokens} tokens, want {want_tokens}"));
    }
    let fillers = got.iter().filter(|(k, _)| k.tray_ns == "m").count();
    let want_fillers = if filter.marked == Some(true) {
        0
    } else {
        FILLERS
    };
    if fillers != want_fillers {
        return Some(format!("{fillers} fillers, want {want_fillers}"));
    }
    None
}

/// Runs the writer for at least `batches` batches and until the readers
/// made `min_reads` reads between them; answers how many reads there were.
/// Panics naming every read that saw a batch in part.
pub(crate) fn snapshot_under_writers(s: &dyn TrayStore, batches: u64, min_reads: usize) -> usize {
    let i = fresh_instance();
    let mut ops: Vec<TrayOp> = (0..FILLERS)
        .map(|n| put("m", &format!("{n:05}"), tray(false, format!("filler {n}"))))
        .collect();
    ops.extend(batch(0));
    s.apply_batch(&i, EPOCH, ops).expect("the fixture");
    let done = AtomicBool::new(false);
    let reads = AtomicUsize::new(0);
    let filters = [
        TrayFilter::new(),
        TrayFilter::new().marked(true),
        TrayFilter::new().marked(false),
    ];
    let bad: Vec<String> = std::thread::scope(|sc| {
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let (i, done, reads, filters) = (&i, &done, &reads, &filters);
                sc.spawn(move || {
                    let mut bad = Vec::new();
                    let mut n = r;
                    while !done.load(Ordering::SeqCst) {
                        let f = &filters[n % filters.len()];
                        n += 1;
                        match s.instance_trays(i, EPOCH, f) {
                            Ok(got) => {
                                if let Some(v) = violation(f, &got) {
                                    bad.push(format!("reader {r}, read {n} ({f:?}): {v}"));
                                }
                            }
                            Err(e) => bad.push(format!("reader {r}, read {n} ({f:?}): {e:?}")),
                        }
                        reads.fetch_add(1, Ordering::SeqCst);
                        if bad.len() > 10 {
                            // Enough to report: stop the writer too.
                            done.store(true, Ordering::SeqCst);
                        }
                    }
                    bad
                })
            })
            .collect();
        let writer = {
            let (i, done, reads) = (&i, &done, &reads);
            sc.spawn(move || {
                let _stop = Stop(done);
                let deadline = Instant::now() + Duration::from_secs(120);
                let mut n = 1;
                while !done.load(Ordering::SeqCst)
                    && (n <= batches || reads.load(Ordering::SeqCst) < min_reads)
                {
                    s.apply_batch(i, EPOCH, batch(n)).expect("a batch");
                    n += 1;
                    assert!(
                        Instant::now() < deadline,
                        "the readers made {} reads in 2 minutes",
                        reads.load(Ordering::SeqCst)
                    );
                }
            })
        };
        writer.join().expect("the writer");
        readers
            .into_iter()
            .flat_map(|r| r.join().expect("a reader"))
            .collect()
    });
    assert!(
        bad.is_empty(),
        "T7: instance_trays saw a batch in part (not one snapshot): {bad:#?}"
    );
    reads.into_inner()
}

/// Sets the flag when dropped: the readers stop also when the writer
/// panics.
struct Stop<'a>(&'a AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn t7_one_snapshot_under_writers_memory() {
    snapshot_under_writers(&agentstate::MemoryStore::new(), 2_000, 200);
}

#[test]
fn t7_one_snapshot_under_writers_file() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let s = agentstate::FileStore::open(dir.path().join("s")).expect("open");
    snapshot_under_writers(&s, 300, 100);
}

#[cfg(feature = "sled")]
#[test]
fn t7_one_snapshot_under_writers_sled() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let s = agentstate::FileStore::open_sled(dir.path().join("s")).expect("open on sled");
    snapshot_under_writers(&s, 300, 100);
}

#[cfg(feature = "redis")]
#[test]
fn t7_one_snapshot_under_writers_redis() {
    let url = crate::redis_server::shared_url(0);
    let s = agentstate::RedisStore::connect_with(&url, agentstate::RedisOptions::new())
        .expect("connect to the test redis-server");
    snapshot_under_writers(&s, 500, 100);
}

#[cfg(feature = "postgres")]
#[test]
fn t7_one_snapshot_under_writers_postgres() {
    let s = crate::postgres::store(agentstate::Options::new());
    snapshot_under_writers(&s, 300, 100);
}

/// A backend with every tray call but `instance_trays`, which it takes
/// from the trait's default.
struct Paged(MemoryStore);

impl TrayStore for Paged {
    fn read_tray(&self, key: &TrayKey, epoch: u64) -> Result<Option<Tray>> {
        self.0.read_tray(key, epoch)
    }
    fn write_tray(&self, key: &TrayKey, epoch: u64, tray: Tray) -> Result<()> {
        self.0.write_tray(key, epoch, tray)
    }
    fn delete_tray(&self, key: &TrayKey, epoch: u64) -> Result<bool> {
        self.0.delete_tray(key, epoch)
    }
    fn apply_batch(&self, instance: &InstanceKey, epoch: u64, ops: Vec<TrayOp>) -> Result<()> {
        self.0.apply_batch(instance, epoch, ops)
    }
    fn apply_batch_idempotent(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        key: &IdempotencyKey,
    ) -> Result<()> {
        self.0.apply_batch_idempotent(instance, epoch, ops, key)
    }
    fn release(&self, instance: &InstanceKey, epoch: u64) -> Result<()> {
        self.0.release(instance, epoch)
    }
    fn list_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        page: &PageRequest,
    ) -> Result<Page<(TrayKey, Tray)>> {
        self.0.list_trays(instance, epoch, page)
    }
    fn marked_trays(&self, env: Option<&str>, page: &PageRequest) -> Result<Page<MarkedTray>> {
        self.0.marked_trays(env, page)
    }
    fn epoch(&self, instance: &InstanceKey) -> Result<u64> {
        self.0.epoch(instance)
    }
    fn set_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<()> {
        self.0.set_alarm(instance, epoch, due_at)
    }
    fn due_alarms(&self, now: Millis, page: &PageRequest) -> Result<Page<Alarm>> {
        self.0.due_alarms(now, page)
    }
    fn ack_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<bool> {
        self.0.ack_alarm(instance, epoch, due_at)
    }
}

/// The default `instance_trays` pages past `PAGE_ITEMS_MAX`, filters,
/// sorts, fences at its epoch and checks the filter's id first,
/// answering what a backend's own one-snapshot call answers.
#[test]
fn default_instance_trays_pages_filters_and_fences() {
    let s = Paged(MemoryStore::new());
    let i = InstanceKey::new("ns", "i");
    let ops = (0..2_500)
        .map(|n| TrayOp::Put {
            tray_ns: ["b", "a", "B", "a\0"][n % 4].to_string(),
            tray_id: format!("{}", n * 7 % 2_500),
            tray: Tray {
                marked: n % 3 == 0,
                doc: n.to_string().into_bytes(),
                env: "e".into(),
                hostname: "h".into(),
            },
        })
        .collect();
    s.apply_batch(&i, 2, ops).unwrap();
    s.set_alarm(&i, 2, 5).unwrap();
    for f in [
        TrayFilter::new(),
        TrayFilter::new().marked(true),
        TrayFilter::new().marked(false),
        TrayFilter::new().tray_ns("a"),
        TrayFilter::new().tray_ns("a\0").marked(true),
        TrayFilter::new().tray_ns("pinned"),
    ] {
        let got = s.instance_trays(&i, 2, &f).unwrap();
        assert_eq!(got, s.0.instance_trays(&i, 2, &f).unwrap(), "{f:?}");
        assert!(got.iter().all(|(k, t)| f.matches(k, t)), "{f:?}");
    }
    assert_eq!(
        s.instance_trays(&i, 2, &TrayFilter::new()).unwrap().len(),
        2_500
    );
    // The fence, at every page: below it `FenceLost`, above it moved.
    assert!(matches!(
        s.instance_trays(&i, 1, &TrayFilter::new()),
        Err(StateError::FenceLost {
            caller: 1,
            stored: 2,
            ..
        })
    ));
    assert_eq!(
        s.instance_trays(&i, 4, &TrayFilter::new()).unwrap().len(),
        2_500
    );
    assert_eq!(s.epoch(&i).unwrap(), 4);
    // A bad filter is refused before the fence could move.
    assert!(matches!(
        s.instance_trays(&i, 9, &TrayFilter::new().tray_ns("")),
        Err(StateError::Invalid { .. })
    ));
    assert_eq!(s.epoch(&i).unwrap(), 4);
}
