//! Named limits, checked on entry (rules K1–K5, K7).

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
/// The largest epoch a tray call may carry (rule K7): `i64::MAX`, the
/// largest value of the `bigint` column the seeds' PostgreSQL store keeps
/// epochs in (`pinned_epoch.epoch`), so an epoch every backend accepts is
/// one every backend can store. Past it a call is `Invalid` and changes
/// nothing.
pub const EPOCH_MAX: u64 = i64::MAX as u64;
/// Most requests one group commit takes at once.
pub const GROUP_JOBS_MAX: usize = 512;

const _: () = assert!(PAGE_ITEMS_DEFAULT <= PAGE_ITEMS_MAX);
const _: () = assert!(ID_BYTES_MAX < RECORD_BYTES_MAX_DEFAULT);

/// Most live holds one run may have at once (rule B2); a reserve past it
/// is `Invalid`.
pub const HOLDS_PER_RUN_MAX: usize = 1024;
/// Longest time to live of a hold: 7 days, in milliseconds (rule B5).
pub const HOLD_TTL_MILLIS_MAX: u64 = 7 * 24 * 60 * 60 * 1000;

/// Idempotency keys are 1..=128 bytes of UTF-8 (rule I3).
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 128;
/// How many idempotency keys a tenant (or an instance namespace) keeps by
/// default before the oldest are forgotten (rule I5); see
/// `Options::idempotency_window`.
pub const IDEMPOTENCY_KEYS_DEFAULT: u64 = 100_000;
/// How long an idempotency key is kept by default: 24 hours, in
/// milliseconds of the store's clock (rule I5).
pub const IDEMPOTENCY_TTL_MILLIS_DEFAULT: u64 = 24 * 60 * 60 * 1000;
/// The most keys one keyed write forgets while pruning the window, so a
/// write's cost stays bounded however far behind the pruning is.
pub const IDEMPOTENCY_PRUNE_MAX: usize = 4;

const _: () = assert!(IDEMPOTENCY_KEY_BYTES_MAX <= ID_BYTES_MAX);
const _: () = assert!(IDEMPOTENCY_PRUNE_MAX >= 2);

/// The most labels one run or session carries (rule R11).
pub const LABELS_MAX: usize = 32;
/// Label keys are 1..=128 bytes of UTF-8, no NUL (rule R11).
pub const LABEL_KEY_BYTES_MAX: usize = 128;
/// A label's value is at most 1024 bytes of canonical JSON (rule R11).
pub const LABEL_VALUE_BYTES_MAX: usize = 1024;
