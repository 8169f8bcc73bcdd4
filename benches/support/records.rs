//! The runs every benchmark and probe writes: one tenant, UUID-like ids,
//! records of realistic size (one pending tool call), 1% running, and the
//! thread CPU clock the growth part and `create_probe` time calls with.
//! Shared by `benches/compare.rs` and the `open`, `page`, `write` and
//! `create` probes in `examples/` (each includes this file with `#[path]`),
//! so their figures are of the same data.

use agentstate::{RunKey, RunRecord, RunState, ToolCall};

pub const TENANT: &str = "acme";
/// Tool-call arguments that make an encoded run record about 300 bytes.
pub const ARGS: &str = r#"{"query":"quarterly revenue by region for the last four quarters","max_results":25,"filters":{"region":["emea","apac","amer"],"currency":"EUR"},"include_sources":true,"note":"benchmark record of realistic size"}"#;

/// A run id shaped like a UUID: random order, so a listing's lookups land
/// all over the key space as they would in production.
///
/// `AGENTSTATE_BENCH_IDS=sequential` makes them ascend with `i` instead
/// (ULID-like), for the locality experiment in docs/benchmarks-lab-notes.md.
pub fn run_id(i: u64) -> String {
    static SEQUENTIAL: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
        std::env::var("AGENTSTATE_BENCH_IDS").is_ok_and(|v| v == "sequential")
    });
    if *SEQUENTIAL {
        format!("{i:016x}{:016x}", mix(i))
    } else {
        format!("{:016x}{:016x}", mix(i), mix(i ^ 0x5bd1_e995_0000_0000))
    }
}

/// splitmix64's finaliser.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

pub fn record(tenant: &str, id: String, state: RunState) -> RunRecord {
    let mut r = RunRecord::new(RunKey::new(tenant, id), "planner");
    r.state = state;
    r.pending_tool_calls = vec![ToolCall {
        id: "call_01".into(),
        name: "web_search".into(),
        arguments: ARGS.into(),
    }];
    r
}

/// State of the i-th run of a listing tenant: 1% running, 99% finished.
pub fn listing_state(i: u64) -> RunState {
    if i.is_multiple_of(100) {
        RunState::Running
    } else {
        RunState::Completed
    }
}

/// Wall-clock milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// CPU time of the calling thread, ns: unlike the wall clock, it does not
/// count the time other processes hold the core.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Context switches so far, `(voluntary, involuntary)`: of the calling
/// thread (`thread == true`, `RUSAGE_THREAD`) or of the whole process,
/// every thread's summed. A voluntary switch is a wait (a lock, a
/// condvar, I/O); an involuntary one a preemption: the scheduler gave the
/// core to another thread mid-work.
pub fn context_switches(thread: bool) -> (u64, u64) {
    let who = if thread {
        libc::RUSAGE_THREAD
    } else {
        libc::RUSAGE_SELF
    };
    // SAFETY: an all-zero rusage is a valid value of that plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage through a valid pointer.
    let rc = unsafe { libc::getrusage(who, &mut ru) };
    assert_eq!(rc, 0, "getrusage");
    (ru.ru_nvcsw as u64, ru.ru_nivcsw as u64)
}
