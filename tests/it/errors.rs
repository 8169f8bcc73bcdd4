//! Errors that tell the truth (E3, D3): wrapped I/O errors keep their
//! `source()` and say each thing once; only what a retry can fix is
//! retryable; bad paths are named precisely.
//!
//! The disk-full and read-only cases mount a small tmpfs, which needs root
//! (CI runs as root); without it they fail, naming what is missing.

use std::error::Error as _;
use std::io::ErrorKind;
use std::path::PathBuf;
use std::process::Command;

use agentstate::{
    FileStore, Options, PersistenceReason, RunKey, RunRecord, StateError, StateStore, ToolCall,
};

/// A tmpfs of `size` mounted on a fresh directory, unmounted on drop.
struct Tmpfs {
    _dir: tempfile::TempDir,
    at: PathBuf,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join("mnt");
        std::fs::create_dir(&at).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&at)
            .output()
            .expect("running mount(8): install util-linux (apt-get install -y mount)");
        assert!(
            out.status.success(),
            "mount -t tmpfs failed ({}): these tests need root with CAP_SYS_ADMIN (CI runs as root)",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Tmpfs { _dir: dir, at }
    }

    fn remount_read_only(&self) {
        let out = Command::new("mount")
            .args(["-o", "remount,ro"])
            .arg(&self.at)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "remounting read-only: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

fn big_run(i: usize) -> RunRecord {
    let mut r = RunRecord::new(RunKey::new("acme", format!("run-{i:05}")), "planner");
    // Incompressible-ish arguments, so the journal grows fast.
    let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let args: String = (0..12_000)
        .map(|n| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Words, not one long token: nothing the scrubber redacts.
            if n % 6 == 5 {
                ' '
            } else {
                char::from(b'a' + (x % 26) as u8)
            }
        })
        .collect();
    r.pending_tool_calls = vec![ToolCall {
        id: "c".into(),
        name: "n".into(),
        arguments: format!("{{\"blob\":\"{args}\"}}"),
    }];
    r
}

/// What every wrapped I/O error must show: the prefix once, the OS's
/// words once, and the I/O error itself as `source()`.
#[track_caller]
fn assert_says_once(e: &StateError, kind: ErrorKind) {
    let text = e.to_string();
    assert_eq!(
        text.matches("persistence failed").count(),
        1,
        "said twice: {text}"
    );
    let src = e
        .source()
        .unwrap_or_else(|| panic!("no source() for {text}"));
    let io = src
        .downcast_ref::<std::io::Error>()
        .unwrap_or_else(|| panic!("source() of {text} is not an io::Error"));
    assert_eq!(io.kind(), kind, "{text}");
    let os = io.to_string();
    assert_eq!(text.matches(os.as_str()).count(), 1, "{os:?} in {text}");
}

#[test]
fn e3_a_full_disk_says_so_once_and_keeps_its_source() {
    let fs = Tmpfs::mount("4m");
    // Memtables bigger than the disk: the journal's write is what fails
    // (a memtable flush failing first would poison fjall, an error with
    // no I/O source).
    let store = FileStore::open_with(
        fs.at.join("store"),
        agentstate::Options::new().write_buffer_bytes(40 << 20),
    )
    .unwrap();
    // Four writers, so a failed group has several callers: each gets the
    // error itself, not its text wrapped again.
    let errors: Vec<StateError> = std::thread::scope(|scope| {
        let hs: Vec<_> = (0..4)
            .map(|w| {
                let store = &store;
                scope.spawn(move || {
                    (0..500)
                        .find_map(|i| store.put_run(big_run(w * 1000 + i)).err())
                        .expect("4 MiB filled up without an error")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errors {
        assert_eq!(
            e.to_string().matches("persistence failed").count(),
            1,
            "said twice: {e}"
        );
    }
    let e = errors
        .into_iter()
        .find(|e| e.source().is_some())
        .expect("no writer's error kept the I/O error as source()");
    // The group reached the journal: whether it is there after a reopen
    // is unknown (I7), and an unkeyed put is not safely retryable as is.
    assert!(
        matches!(
            e,
            StateError::Persistence {
                reason: PersistenceReason::OutcomeUnknown { keyed: false },
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.is_outcome_unknown());
    assert!(
        !e.is_retryable(),
        "an unkeyed write of unknown outcome: {e}"
    );
    assert_says_once(&e, ErrorKind::StorageFull);
    // What the store refuses after it certainly did not apply: retryable.
    let refused = store.put_run(big_run(9_999)).unwrap_err();
    assert!(
        matches!(
            refused,
            StateError::Persistence {
                reason: PersistenceReason::Unavailable,
                ..
            }
        ) && refused.is_retryable(),
        "{refused:?}"
    );
}

#[test]
fn e3_io_error_kinds_map_to_truthful_reasons() {
    // The mapping alone, with the OS's own error: ENOSPC.
    let e = StateError::Persistence {
        reason: PersistenceReason::of_io(&std::io::Error::from_raw_os_error(28)),
        detail: "x".into(),
        source: None,
    };
    assert!(e.is_retryable());
    for (code, kind, reason) in [
        (
            30,
            ErrorKind::ReadOnlyFilesystem,
            PersistenceReason::ReadOnly,
        ),
        (
            36,
            ErrorKind::InvalidFilename,
            PersistenceReason::InvalidPath,
        ),
        (20, ErrorKind::NotADirectory, PersistenceReason::InvalidPath),
        (28, ErrorKind::StorageFull, PersistenceReason::Unavailable),
        (5, ErrorKind::Other, PersistenceReason::Unavailable),
    ] {
        let io = std::io::Error::from_raw_os_error(code);
        if kind != ErrorKind::Other {
            assert_eq!(io.kind(), kind);
        }
        assert_eq!(PersistenceReason::of_io(&io), reason, "os error {code}");
    }
}

#[test]
fn e3_a_read_only_file_system_is_not_retryable() {
    let fs = Tmpfs::mount("8m");
    let path = fs.at.join("store");
    {
        let s = FileStore::open(&path).unwrap();
        s.put_run(RunRecord::new(RunKey::new("acme", "r"), "planner"))
            .unwrap();
    }
    fs.remount_read_only();
    // The mount point itself too: creating a store there renames onto
    // it, which a read-only mount refuses (EROFS) and any mount point
    // refuses with EBUSY; neither is retryable.
    let empty = Tmpfs::mount("1m");
    empty.remount_read_only();
    for p in [path.clone(), fs.at.join("new-store")] {
        let e = FileStore::open(&p).map(|_| ()).unwrap_err();
        assert!(
            matches!(
                e,
                StateError::Persistence {
                    reason: PersistenceReason::ReadOnly,
                    ..
                }
            ),
            "{}: {e:?}",
            p.display()
        );
        assert!(!e.is_retryable(), "no retry can write a read-only fs: {e}");
        assert_says_once(&e, ErrorKind::ReadOnlyFilesystem);
    }
    let e = FileStore::open(&empty.at).map(|_| ()).unwrap_err();
    assert!(
        matches!(
            e,
            StateError::Persistence {
                reason: PersistenceReason::InvalidPath | PersistenceReason::ReadOnly,
                ..
            }
        ) && !e.is_retryable(),
        "the mount point itself: {e:?}"
    );
    assert!(e.to_string().contains("mount point"), "{e}");
}

#[test]
fn e3_a_name_too_long_is_not_retryable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("n".repeat(256));
    let e = FileStore::open(&path).map(|_| ()).unwrap_err();
    assert!(
        matches!(
            e,
            StateError::Persistence {
                reason: PersistenceReason::InvalidPath,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(!e.is_retryable(), "{e}");
    assert_says_once(&e, ErrorKind::InvalidFilename);
    // Nothing was left beside it.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn d7_every_name_the_file_system_takes_makes_a_store() {
    let dir = tempfile::tempdir().unwrap();
    for len in [1, 200, 240, 241, 245, 250, 254, 255] {
        let path = dir.path().join("s".repeat(len));
        {
            let s = FileStore::open(&path).unwrap_or_else(|e| panic!("a {len}-byte name: {e}"));
            s.put_run(RunRecord::new(RunKey::new("acme", "r"), "planner"))
                .unwrap();
        }
        let s = FileStore::open(&path).unwrap();
        assert!(s.get_run(&RunKey::new("acme", "r")).unwrap().is_some());
    }
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "leftovers: {left:?}");
}

#[test]
fn d7_missing_parents_are_refused_naming_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("typo");
    let path = first.join("deeper").join("store");
    let e = FileStore::open(&path).map(|_| ()).unwrap_err();
    let StateError::Invalid { what } = &e else {
        panic!("{e:?}")
    };
    assert!(
        what.contains(&format!("directory {} does not exist", first.display())),
        "{what}"
    );
    assert!(
        !first.exists(),
        "a refused open created {}",
        first.display()
    );
    // Unless asked for.
    let s = FileStore::open_with(&path, Options::new().create_parents(true)).unwrap();
    s.put_run(RunRecord::new(RunKey::new("acme", "r"), "planner"))
        .unwrap();
    drop(s);
    // An existing store opens either way.
    FileStore::open(&path).unwrap();
}

#[test]
fn d7_a_path_below_a_file_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "hello").unwrap();
    for path in [file.join("store"), file.join("a").join("store")] {
        let e = FileStore::open(&path).map(|_| ()).unwrap_err();
        let StateError::Invalid { what } = &e else {
            panic!("{e:?}")
        };
        assert!(
            what.contains(&format!("{} is a file, not a directory", file.display())),
            "{what}"
        );
        assert!(!what.contains("File exists"), "{what}");
    }
    let with = FileStore::open_with(file.join("store"), Options::new().create_parents(true));
    assert!(matches!(with, Err(StateError::Invalid { .. })));
}

/// I7 on the file store: a write whose commit fails is `OutcomeUnknown`
/// (retryable when keyed), the writes refused after it `Unavailable`;
/// after a reopen, every keyed patch retried with its key until it
/// answers is applied exactly once, and keys kept before the failure
/// survive the reopen (I5).
#[test]
fn i7_a_failed_commit_is_outcome_unknown_and_keyed_retries_apply_once() {
    use agentstate::{IdempotencyKey, InstanceKey, StateDelta, Tray, TrayStore};
    let fs = Tmpfs::mount("4m");
    let path = fs.at.join("store");
    let opts = || agentstate::Options::new().write_buffer_bytes(40 << 20);
    let store = FileStore::open_with(&path, opts()).unwrap();
    let run = store
        .put_run(RunRecord::new(RunKey::new("acme", "spend"), "a"))
        .unwrap();
    let delta = StateDelta {
        cost_micros: 1,
        ..Default::default()
    };
    let pad = |i: u64| Tray {
        marked: false,
        doc: vec![(i % 251) as u8; 16 * 1024],
        env: "e".into(),
        hostname: "h".into(),
    };
    let (mut attempted, mut unknown) = (0u64, 0u64);
    let mut landed: Vec<IdempotencyKey> = Vec::new();
    let mut failed: Vec<IdempotencyKey> = Vec::new();
    for i in 0..100_000u64 {
        if let Err(e) = store.write_tray(
            &InstanceKey::new("pad", "w").tray("t", i.to_string()),
            1,
            pad(i),
        ) {
            assert!(e.is_outcome_unknown() || e.is_retryable(), "{e:?}");
            unknown += u64::from(e.is_outcome_unknown());
        }
        let k = IdempotencyKey::new(format!("patch-{i}")).unwrap();
        attempted += 1;
        match store.patch_run_idempotent(&run.key, delta, &k) {
            Ok(_) => landed.push(k),
            Err(e) => {
                assert!(
                    e.is_retryable(),
                    "a keyed write's failure is retryable: {e:?}"
                );
                unknown += u64::from(e.is_outcome_unknown());
                failed.push(k);
            }
        }
        if failed.len() >= 3 {
            break;
        }
    }
    assert!(
        unknown > 0,
        "no failure was an unknown outcome: the test tested nothing"
    );
    assert!(landed.len() > 10, "only {} patches fit", landed.len());
    drop(store);
    let roomy = tempfile::tempdir().unwrap();
    let copy = roomy.path().join("store");
    let out = Command::new("cp")
        .arg("-a")
        .arg(&path)
        .arg(&copy)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cp: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(fs);
    let store = FileStore::open_with(&copy, opts()).unwrap();
    // The failed ones, retried until they answer; and a few that had
    // landed, whose keys must have survived the reopen.
    for k in failed.iter().chain(landed.iter().rev().take(5)) {
        store
            .patch_run_idempotent(&run.key, delta, k)
            .unwrap_or_else(|e| panic!("retry of {k}: {e:?}"));
    }
    let cost = store.get_run(&run.key).unwrap().unwrap().cost_micros;
    assert_eq!(
        cost,
        attempted,
        "{attempted} distinct patches ({} failed and retried): each must be applied exactly once",
        failed.len()
    );
    eprintln!(
        "i7: {} patches landed, {} failed ({unknown} of unknown outcome), all applied once after retries",
        landed.len(),
        failed.len()
    );
}
