//! Named limits, checked on entry (rules K1–K5).

/// Ids are 1..=256 bytes of UTF-8 (K1).
pub const ID_BYTES_MAX: usize = 256;
/// Default largest encoded record or tray doc (K2); see `Options::record_bytes_max`.
pub const RECORD_BYTES_MAX_DEFAULT: usize = 1024 * 1024;
/// Largest page (K3).
pub const PAGE_ITEMS_MAX: usize = 1000;
/// Page size when none is given (L5).
pub const PAGE_ITEMS_DEFAULT: usize = 100;
/// Largest tray batch (K4).
pub const BATCH_OPS_MAX: usize = 10_000;
/// Most pending tool calls per run (K5).
pub const PENDING_TOOL_CALLS_MAX: usize = 1024;
/// Most requests one group commit takes at once.
pub const GROUP_JOBS_MAX: usize = 512;

const _: () = assert!(PAGE_ITEMS_DEFAULT <= PAGE_ITEMS_MAX);
const _: () = assert!(ID_BYTES_MAX < RECORD_BYTES_MAX_DEFAULT);

/// Most live holds one run may have at once (rule B2); a reserve past it
/// is `Invalid`.
pub const HOLDS_PER_RUN_MAX: usize = 1024;
/// Longest time to live of a hold: 7 days, in milliseconds (rule B5).
pub const HOLD_TTL_MILLIS_MAX: u64 = 7 * 24 * 60 * 60 * 1000;
