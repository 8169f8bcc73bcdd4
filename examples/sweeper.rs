//! The sweeper on the change feed (issue 42): it follows the store's trays
//! feed, wakes each tray a worker left marked the moment the mark commits,
//! and fires each alarm at its due time from a timer it keeps from the
//! feed — with a plain listing of marked trays and due alarms only as the
//! fallback, once a second, in case it ever missed something.
//!
//! ```text
//! cargo run --release --example sweeper             # on a file store in a temp dir
//! cargo run --release --example sweeper -- memory   # on the memory store
//! ```
//!
//! The "workers" are threads here: each writes its trays, one marks a tray
//! (it has work pending and dies), others set alarms. The example checks
//! that every marked tray was woken and every alarm fired exactly once,
//! prints how long after the commit (wake) and after the due time (fire)
//! each happened, and exits non-zero if anything was missed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agentstate::{
    Changed, FeedScope, FileStore, InstanceKey, MemoryStore, PageRequest, Position, Store, Tray,
    TrayKey,
};

const WORKERS: usize = 20;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64
}

/// What the sweeper did, for the checks at the end.
#[derive(Default)]
struct Report {
    /// Marked tray → ms from the mark's commit to its wake.
    woken: BTreeMap<TrayKey, f64>,
    /// Instance → ms from its due time to the fire.
    fired: BTreeMap<InstanceKey, f64>,
    /// How many marked trays and due alarms the fallback found first.
    fallback: usize,
}

fn sweeper(
    store: Arc<dyn Store>,
    stop: Arc<AtomicBool>,
    marked_at: Arc<std::sync::Mutex<BTreeMap<TrayKey, Instant>>>,
) -> Report {
    let scope = FeedScope::trays();
    let mut at = Position::START;
    let mut report = Report::default();
    // The alarms the feed has shown, by instance: the timer.
    let mut alarms: BTreeMap<InstanceKey, u64> = BTreeMap::new();
    let mut last_fallback = Instant::now();
    let mut handled: BTreeSet<TrayKey> = BTreeSet::new();
    // Marked trays the fallback listing found before the feed showed
    // them: checked once the feed has been read past the listing.
    let mut suspects: Vec<TrayKey> = Vec::new();
    loop {
        let next_due = alarms.values().min().copied();
        let wait = match next_due {
            Some(due) => {
                Duration::from_millis(due.saturating_sub(now_ms())).min(Duration::from_secs(1))
            }
            None => Duration::from_secs(1),
        };
        let page = store
            .wait_changes(&scope, at, 1000, wait.max(Duration::from_millis(1)))
            .expect("wait for changes");
        at = page.next;
        for c in page.changes {
            match c.item {
                Changed::Tray { key, tray } if tray.marked && !handled.contains(&key) => {
                    wake(&*store, &key, &tray);
                    let since = marked_at.lock().unwrap().get(&key).map(|t| t.elapsed());
                    report.woken.insert(
                        key.clone(),
                        since.map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0),
                    );
                    handled.insert(key);
                }
                Changed::Alarm { alarm } => {
                    alarms.insert(alarm.instance, alarm.due_at);
                }
                Changed::AlarmDeleted { instance } => {
                    alarms.remove(&instance);
                }
                _ => {}
            }
        }
        // Whatever the listing saw committed before it, so the feed read
        // since has shown it too (F4): anything left is a miss.
        for key in std::mem::take(&mut suspects) {
            if !handled.contains(&key) {
                report.fallback += 1;
                handled.insert(key);
            }
        }
        // The timer: fire what is due.
        let now = now_ms();
        let due: Vec<(InstanceKey, u64)> = alarms
            .iter()
            .filter(|(_, d)| **d <= now)
            .map(|(i, d)| (i.clone(), *d))
            .collect();
        for (instance, due_at) in due {
            let epoch = store.epoch(&instance).expect("epoch");
            if store.ack_alarm(&instance, epoch, due_at).expect("ack") {
                report
                    .fired
                    .insert(instance.clone(), now_ms().saturating_sub(due_at) as f64);
            }
            alarms.remove(&instance);
        }
        // The fallback: a listing once a second, for anything the feed
        // did not show (it never should).
        if last_fallback.elapsed() >= Duration::from_secs(1) {
            last_fallback = Instant::now();
            for m in store.iter_marked_trays(None) {
                let m = m.expect("list marked trays");
                if !handled.contains(&m.key) {
                    suspects.push(m.key);
                }
            }
            // Alarms due a while ago that the timer has not fired.
            for a in store.iter_due_alarms(now_ms().saturating_sub(200)) {
                let a = a.expect("list due alarms");
                if !report.fired.contains_key(&a.instance) {
                    report.fallback += 1;
                }
            }
        }
        if stop.load(Ordering::SeqCst) && alarms.is_empty() && suspects.is_empty() {
            return report;
        }
    }
}

/// Wakes a marked tray: a new worker takes the instance over (the next
/// epoch) and unmarks the tray once it has the work.
fn wake(store: &dyn Store, key: &TrayKey, tray: &Tray) {
    let instance = InstanceKey::new(&key.ns, &key.id);
    let epoch = store.epoch(&instance).expect("epoch") + 1;
    let mut taken = tray.clone();
    taken.marked = false;
    taken.hostname = "sweeper".into();
    store
        .write_tray(key, epoch, taken)
        .expect("take the tray over");
}

fn main() {
    let memory = std::env::args().any(|a| a == "memory");
    let dir = tempfile::tempdir().expect("temp dir");
    let store: Arc<dyn Store> = if memory {
        Arc::new(MemoryStore::new())
    } else {
        Arc::new(FileStore::open(dir.path().join("store")).expect("open the file store"))
    };
    let stop = Arc::new(AtomicBool::new(false));
    let marked_at = Arc::new(std::sync::Mutex::new(BTreeMap::new()));
    let sweeping = {
        let (store, stop, marked_at) = (store.clone(), stop.clone(), marked_at.clone());
        std::thread::spawn(move || sweeper(store, stop, marked_at))
    };
    let began = Instant::now();
    let mut want_woken = BTreeSet::new();
    let mut want_fired = BTreeSet::new();
    for w in 0..WORKERS {
        let instance = InstanceKey::new("chat", format!("room-{w}"));
        let t = |marked: bool| Tray {
            marked,
            doc: format!("work of room {w}").into_bytes(),
            env: "prod".into(),
            hostname: format!("worker-{w}"),
        };
        store
            .write_tray(&instance.tray("state", "main"), 1, t(false))
            .expect("write");
        match w % 3 {
            // Dies with work pending: its tray stays marked.
            0 => {
                let key = instance.tray("state", "inbox");
                let mut m = marked_at.lock().unwrap();
                store.write_tray(&key, 1, t(true)).expect("mark");
                m.insert(key.clone(), Instant::now());
                want_woken.insert(key);
            }
            // Asks to be woken later.
            1 => {
                store
                    .set_alarm(&instance, 1, now_ms() + 20 + 10 * w as u64)
                    .expect("set an alarm");
                want_fired.insert(instance);
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // Let the last alarms come due, then stop the sweeper.
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    let report = sweeping.join().expect("the sweeper panicked");
    let ms = |v: Vec<f64>| {
        let mut v = v;
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() - 1])
    };
    let (wake_med, wake_max) = ms(report.woken.values().copied().collect());
    let (fire_med, fire_max) = ms(report.fired.values().copied().collect());
    println!(
        "sweeper on {}: {} marked trays woken (after their commit: median {wake_med:.2} ms, max {wake_max:.2} ms), {} alarms fired (after their due time: median {fire_med:.0} ms, max {fire_max:.0} ms), {} found by the fallback listing, in {:.2} s",
        if memory { "memory" } else { "file" },
        report.woken.len(),
        report.fired.len(),
        report.fallback,
        began.elapsed().as_secs_f64()
    );
    let woken: BTreeSet<TrayKey> = report.woken.keys().cloned().collect();
    let fired: BTreeSet<InstanceKey> = report.fired.keys().cloned().collect();
    let mut ok = true;
    if woken != want_woken {
        eprintln!("woken {woken:?}, want {want_woken:?}");
        ok = false;
    }
    if fired != want_fired {
        eprintln!("fired {fired:?}, want {want_fired:?}");
        ok = false;
    }
    if report.fallback != 0 {
        eprintln!(
            "the fallback listing found {} the feed missed",
            report.fallback
        );
        ok = false;
    }
    let left = store
        .marked_trays(None, &PageRequest::new(10))
        .expect("list marked trays");
    if !left.items().is_empty() {
        eprintln!("trays still marked: {:?}", left.items());
        ok = false;
    }
    if !ok {
        std::process::exit(1);
    }
}
