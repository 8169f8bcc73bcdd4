//! What the store emits through the `tracing` and `metrics` facades: a span
//! per call naming the backend, the operation and the tenant (never a run
//! id), events for conflicts and lost fences, and counters by kind.

use std::io::Write;
use std::sync::{Arc, Mutex};

use agentstate::{
    InstanceKey, MemoryStore, RunKey, RunRecord, StateError, StateStore, Tray, TrayStore,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::{CompositeKey, MetricKind};

/// A writer the fmt subscriber appends to.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn counter(
    snapshot: &[(
        CompositeKey,
        Option<metrics::Unit>,
        Option<metrics::SharedString>,
        DebugValue,
    )],
    name: &str,
    labels: &[(&str, &str)],
) -> u64 {
    snapshot
        .iter()
        .filter(|(k, ..)| k.kind() == MetricKind::Counter && k.key().name() == name)
        .filter(|(k, ..)| {
            labels
                .iter()
                .all(|(l, v)| k.key().labels().any(|x| x.key() == *l && x.value() == *v))
        })
        .map(|(.., v)| match v {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum()
}

#[test]
fn calls_are_spanned_and_counted_without_their_ids() {
    let out = Captured::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();

    tracing::subscriber::with_default(subscriber, || {
        metrics::with_local_recorder(&recorder, || {
            let store = MemoryStore::new();
            let key = RunKey::new("acme", "secret-run-id-42");
            let run = store
                .put_run(RunRecord::new(key.clone(), "planner"))
                .unwrap();
            // A stale put: a conflict, counted by kind and logged.
            let mut stale = run.clone();
            stale.version = 0;
            assert!(matches!(
                store.put_run(stale),
                Err(StateError::Conflict { .. })
            ));
            assert!(store.get_run(&key).unwrap().is_some());
            // A fenced write: a lost fence.
            let inst = InstanceKey::new("py", "worker-secret-7");
            let tray = inst.tray("state", "main");
            store.write_tray(&tray, 2, tray_doc()).unwrap();
            assert!(matches!(
                store.write_tray(&tray, 1, tray_doc()),
                Err(StateError::FenceLost { .. })
            ));
        })
    });

    let snap = snapshotter.snapshot().into_vec();
    let calls = |op| {
        counter(
            &snap,
            "agentstate_calls_total",
            &[("backend", "memory"), ("op", op)],
        )
    };
    assert_eq!(calls("put_run"), 2);
    assert_eq!(calls("get_run"), 1);
    assert_eq!(calls("write_tray"), 2);
    assert_eq!(
        counter(
            &snap,
            "agentstate_errors_total",
            &[("op", "put_run"), ("kind", "conflict")]
        ),
        1
    );
    assert_eq!(
        counter(&snap, "agentstate_errors_total", &[("kind", "fence_lost")]),
        1
    );
    assert!(
        snap.iter().any(|(k, ..)| k.kind() == MetricKind::Histogram
            && k.key().name() == "agentstate_call_duration_seconds"),
        "a latency histogram"
    );

    let log = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    assert!(log.contains("version conflict"), "{log}");
    assert!(log.contains("fence lost"), "{log}");
    assert!(log.contains("op=\"put_run\""), "{log}");
    assert!(log.contains("tenant=\"acme\""), "{log}");
    assert!(log.contains("backend=\"memory\""), "{log}");
    // Ids may hold user data: never in a span or an event.
    assert!(!log.contains("secret-run-id-42"), "{log}");
    assert!(!log.contains("worker-secret-7"), "{log}");
}

#[test]
fn nothing_is_recorded_without_a_recorder_or_subscriber() {
    // No recorder installed here: the calls work and nothing panics; a
    // recorder installed afterwards has seen nothing of them.
    let store = MemoryStore::new();
    store
        .put_run(RunRecord::new(RunKey::new("acme", "r"), "planner"))
        .unwrap();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {});
    assert!(snapshotter.snapshot().into_vec().is_empty());
}

fn tray_doc() -> Tray {
    Tray {
        marked: false,
        doc: b"{}".to_vec(),
        env: "prod".into(),
        hostname: "h".into(),
    }
}
