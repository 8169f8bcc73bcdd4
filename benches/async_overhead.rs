//! What the async wrapper costs over the synchronous call (issue 40):
//! `AsyncStore` against the same store called directly, on the memory
//! store and the file store, awaited in sequence by one task on a
//! current-thread runtime and on a multi-thread runtime.
//!
//! ```text
//! cargo bench --features async --bench async_overhead
//! cargo bench --features async --bench async_overhead -- --quick
//! ```
//!
//! Contenders alternate in rounds (direct, async current-thread, async
//! multi-thread), so a machine's drift hits all three alike; each figure is
//! the median of the rounds' mean ns per call. The target on memory: the
//! async call ≤ 2x the direct call + 5 µs. Prints one `RESULT name=value`
//! line per figure; no test asserts a time.

use std::sync::Arc;
use std::time::Instant;

use agentstate::{
    AsyncStore, Durability, FileStore, MemoryStore, Options, RunKey, RunRecord, StateDelta, Store,
};

const ROUNDS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One call kind on one store: ns per call, per contender.
struct Figures {
    direct: Vec<f64>,
    current: Vec<f64>,
    multi: Vec<f64>,
}

#[derive(Clone, Copy)]
enum Op {
    Get,
    Patch,
}

fn direct(store: &dyn Store, keys: &[RunKey], op: Op) -> f64 {
    let t = Instant::now();
    for k in keys {
        match op {
            Op::Get => drop(std::hint::black_box(store.get_run(k).unwrap())),
            Op::Patch => drop(std::hint::black_box(store.patch_run(k, delta()).unwrap())),
        }
    }
    t.elapsed().as_nanos() as f64 / keys.len() as f64
}

async fn awaited(store: &AsyncStore, keys: &[RunKey], op: Op) -> f64 {
    let t = Instant::now();
    for k in keys {
        match op {
            Op::Get => drop(std::hint::black_box(store.get_run(k).await.unwrap())),
            Op::Patch => drop(std::hint::black_box(
                store.patch_run(k, delta()).await.unwrap(),
            )),
        }
    }
    t.elapsed().as_nanos() as f64 / keys.len() as f64
}

fn delta() -> StateDelta {
    StateDelta {
        iterations: 1,
        ..Default::default()
    }
}

fn measure(name: &str, sync: Arc<dyn Store>, wrapped: AsyncStore, n: usize, ops: &[Op]) {
    let keys: Vec<RunKey> = (0..n)
        .map(|i| RunKey::new("bench", format!("run-{i:07}")))
        .collect();
    for k in &keys {
        sync.put_run(RunRecord::new(k.clone(), "planner")).unwrap();
    }
    let current = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for &op in ops {
        let mut f = Figures {
            direct: Vec::new(),
            current: Vec::new(),
            multi: Vec::new(),
        };
        for _ in 0..ROUNDS {
            f.direct.push(direct(&*sync, &keys, op));
            f.current
                .push(current.block_on(awaited(&wrapped, &keys, op)));
            let (w, k) = (wrapped.clone(), keys.clone());
            f.multi.push(
                multi
                    .block_on(multi.spawn(async move { awaited(&w, &k, op).await }))
                    .unwrap(),
            );
        }
        let op_name = match op {
            Op::Get => "get_run",
            Op::Patch => "patch_run",
        };
        let (d, c, m) = (median(f.direct), median(f.current), median(f.multi));
        let target = 2.0 * d + 5000.0;
        println!(
            "{name:<8} {op_name:<10} direct {d:>9.0} ns  async current-thread {c:>9.0} ns ({:.2}x)  async multi-thread {m:>9.0} ns ({:.2}x)  target <= {target:.0} ns: {}",
            c / d,
            m / d,
            if c.max(m) <= target { "met" } else { "missed" }
        );
        println!("RESULT async_{name}_{op_name}_direct_ns={d:.0}");
        println!("RESULT async_{name}_{op_name}_current_ns={c:.0}");
        println!("RESULT async_{name}_{op_name}_multi_ns={m:.0}");
        println!(
            "RESULT async_{name}_{op_name}_current_vs_direct={:.3}",
            c / d
        );
        println!("RESULT async_{name}_{op_name}_multi_vs_direct={:.3}", m / d);
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let n = if quick { 2_000 } else { 20_000 };
    println!("# agentstate async_overhead ({n} calls per round, {ROUNDS} rounds, medians)");

    // Built from the store's own type, the wrapper runs memory calls in
    // the caller's task; an `Arc<dyn Store>` goes through the blocking pool.
    let inline = AsyncStore::new(MemoryStore::new());
    let sync: Arc<dyn Store> = inline.sync_store().clone();
    measure("memory", sync, inline, n, &[Op::Get, Op::Patch]);
    let pooled: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let wrapped = AsyncStore::from(Arc::clone(&pooled));
    measure("memory_pool", pooled, wrapped, n / 4, &[Op::Get]);

    let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("async-overhead");
    std::fs::create_dir_all(&base).unwrap();
    let dir = tempfile::tempdir_in(&base).unwrap();
    // Buffered: the sync itself (a disk flush) would hide the wrapper's cost.
    let file = FileStore::open_with(
        dir.path().join("file"),
        Options::new().durability(Durability::Buffered),
    )
    .unwrap();
    let store = AsyncStore::from(file);
    let sync: Arc<dyn Store> = store.sync_store().clone();
    measure("file", sync, store, n / 4, &[Op::Get, Op::Patch]);
}
