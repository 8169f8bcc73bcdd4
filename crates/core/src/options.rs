//! How a store is opened: options every backend reads (clock, record
//! limit, scrubber) and the file store's own (durability, salvage, engine).

use std::sync::Arc as StdArc;

use crate::clock::{Clock, SystemClock};
use crate::limits::RECORD_BYTES_MAX_DEFAULT;
use crate::scrub::Scrubber;

/// What an acknowledged write survives (file store only; the memory store
/// keeps nothing past its process).
///
/// | mode | process crash (`kill -9`) | OS crash / power loss |
/// |---|---|---|
/// | `Immediate` (default) | survives | survives, on disks that honour `fdatasync` |
/// | `Buffered` | survives | may lose the last writes (never a torn one) |
///
/// In JSON: `"immediate"` or `"buffered"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Durability {
    /// Every acknowledged write was synced (`fdatasync`) before `Ok`; writers
    /// that arrive together share one sync.
    #[default]
    Immediate,
    /// Writes reach the operating system before `Ok` but are not synced. A
    /// process crash loses nothing; an OS crash or power cut can lose the
    /// most recent acknowledged writes (whole groups, never part of one).
    Buffered,
}

/// The engine under a file store's directory.
///
/// A store keeps the engine it was created with: opening it with the other
/// one is an `InvalidInput` error that names the right one.
///
/// | engine | `Durability::Immediate` means | readers during a sync |
/// |---|---|---|
/// | `Fjall` (default) | fjall's journal `fdatasync`ed per group | not blocked |
/// | `Sled` (feature `sled`) | sled flushed, then its data and blob files `fdatasync`ed per group | wait for it |
///
/// In JSON: its name, `"fjall"` or `"sled"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileEngine {
    /// fjall 3 (an LSM tree with a journal). The default, and the faster.
    #[default]
    Fjall,
    /// sled 0.34. Needs the crate's `sled` feature; without it, opening
    /// with this engine is an `InvalidInput` error.
    Sled,
}

impl FileEngine {
    /// The engine's name as the store's `ENGINE` file records it.
    pub fn name(self) -> &'static str {
        match self {
            FileEngine::Fjall => "fjall",
            FileEngine::Sled => "sled",
        }
    }
}

/// How far the one-time upgrade of an older file store's layout has got
/// (see [`Options::on_upgrade`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct UpgradeProgress {
    /// Runs moved into the current layout so far.
    pub done: u64,
    /// Runs the store held when the upgrade (or this part of it) began.
    pub total: u64,
}

impl UpgradeProgress {
    /// `done` of `total` records moved.
    pub fn new(done: u64, total: u64) -> Self {
        UpgradeProgress { done, total }
    }
}

/// Called with the upgrade's progress.
type ProgressFn = StdArc<dyn Fn(UpgradeProgress) + Send + Sync>;

/// How a store is opened.
#[derive(Clone)]
pub struct Options {
    pub clock: StdArc<dyn Clock>,
    pub record_bytes_max: usize,
    pub scrubber: Scrubber,
    pub durability: Durability,
    pub salvage: bool,
    pub create_parents: bool,
    pub engine: FileEngine,
    pub on_upgrade: Option<ProgressFn>,
    pub cache_bytes: u64,
    pub write_buffer_bytes: u64,
    pub flush_at_close: bool,
    pub idempotency: IdempotencyWindow,
}

/// How long a store remembers idempotency keys (rule I5): at most
/// `keys_max` per tenant (trays: per instance namespace), each for at most
/// `ttl_millis` of the store's clock. Keys past either bound are forgotten
/// by later keyed writes of the same tenant, a few at a time: a repeat of
/// a forgotten key applies again. Keep the window longer than the longest
/// time a caller may keep retrying one operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IdempotencyWindow {
    /// Most keys kept per tenant (at least 1).
    pub keys_max: u64,
    /// Longest time a key is kept, in milliseconds (at least 1).
    pub ttl_millis: u64,
}

impl Default for IdempotencyWindow {
    /// 100,000 keys and 24 hours ([`crate::limits::IDEMPOTENCY_KEYS_DEFAULT`],
    /// [`crate::limits::IDEMPOTENCY_TTL_MILLIS_DEFAULT`]).
    fn default() -> Self {
        IdempotencyWindow {
            keys_max: crate::limits::IDEMPOTENCY_KEYS_DEFAULT,
            ttl_millis: crate::limits::IDEMPOTENCY_TTL_MILLIS_DEFAULT,
        }
    }
}

/// The block cache's default size (fjall engine): 16 MiB.
pub const CACHE_BYTES_DEFAULT: u64 = 16 << 20;
/// The write buffer's default size (fjall engine): 5 MiB, so one memtable
/// is 1 MiB. A range scan steps over every version a memtable holds of the
/// keys in its range, so a small memtable keeps scans of often-rewritten
/// keys (pages of running runs, trays, alarms) from slowing down between
/// flushes (docs/benchmarks-lab-notes.md, "Latency growth").
pub const WRITE_BUFFER_BYTES_DEFAULT: u64 = 5 << 20;
/// The smallest write buffer `Options::write_buffer_bytes` accepts: 4 MiB.
pub const WRITE_BUFFER_BYTES_MIN: u64 = 4 << 20;

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("record_bytes_max", &self.record_bytes_max)
            .field("durability", &self.durability)
            .field("salvage", &self.salvage)
            .field("create_parents", &self.create_parents)
            .field("engine", &self.engine)
            .field("cache_bytes", &self.cache_bytes)
            .field("write_buffer_bytes", &self.write_buffer_bytes)
            .field("flush_at_close", &self.flush_at_close)
            .field("idempotency", &self.idempotency)
            .finish_non_exhaustive()
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            clock: StdArc::new(SystemClock),
            record_bytes_max: RECORD_BYTES_MAX_DEFAULT,
            scrubber: Scrubber::default(),
            durability: Durability::Immediate,
            salvage: false,
            create_parents: false,
            engine: FileEngine::Fjall,
            on_upgrade: None,
            cache_bytes: CACHE_BYTES_DEFAULT,
            write_buffer_bytes: WRITE_BUFFER_BYTES_DEFAULT,
            flush_at_close: true,
            idempotency: IdempotencyWindow::default(),
        }
    }
}

impl Options {
    /// System clock, 1 MiB records, default scrubber, `Durability::Immediate`,
    /// the fjall engine with a 16 MiB block cache and a 5 MiB write
    /// buffer, flushed at a clean close.
    pub fn new() -> Self {
        Self::default()
    }
    /// The clock `created_at`/`updated_at` are read from.
    pub fn clock(mut self, clock: StdArc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }
    /// The largest encoded record or tray doc (K2), at least 4 KiB.
    pub fn record_bytes_max(mut self, bytes: usize) -> Self {
        self.record_bytes_max = bytes.max(4096);
        self
    }
    /// The scrubber applied to every run written (X1).
    pub fn scrubber(mut self, scrubber: Scrubber) -> Self {
        self.scrubber = scrubber;
        self
    }
    /// What an `Ok` survives (file store).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }
    /// Open a file store even when it recovered to less than it had
    /// acknowledged (D8). For operators rescuing what is left; the store's
    /// high-water mark is reset to what was recovered.
    pub fn salvage(mut self, salvage: bool) -> Self {
        self.salvage = salvage;
        self
    }
    /// Create the missing parent directories of a new file store's path
    /// (default: no — a path whose parent does not exist is refused with
    /// `Invalid` naming the first missing directory, so a typo in a path
    /// does not make a new empty store somewhere else).
    pub fn create_parents(mut self, create: bool) -> Self {
        self.create_parents = create;
        self
    }
    /// The engine a new file store is created with, and the one an existing
    /// store must have been created with (file store).
    pub fn engine(mut self, engine: FileEngine) -> Self {
        self.engine = engine;
        self
    }
    /// Called while a file store written by an older release is upgraded
    /// to this release's layout, which happens once, inside the open that
    /// first finds it (after each batch of runs moved, and once before the
    /// first). The upgrade is crash-safe: stopped at any moment, the next
    /// open goes on where it stopped. The CLI prints it.
    pub fn on_upgrade(mut self, f: impl Fn(UpgradeProgress) + Send + Sync + 'static) -> Self {
        self.on_upgrade = Some(StdArc::new(f));
        self
    }
    /// The block cache of a file store (fjall engine; sled ignores it):
    /// table blocks kept in memory after a read, so the next read of them
    /// costs no disk access or decoding. Default
    /// `CACHE_BYTES_DEFAULT` (16 MiB). A bigger cache helps stores whose
    /// hot runs do not fit; it never grows past this.
    pub fn cache_bytes(mut self, bytes: u64) -> Self {
        self.cache_bytes = bytes;
        self
    }
    /// The most memory writes not yet flushed into a table may hold (fjall
    /// engine; sled ignores it): the active memtable and the sealed ones
    /// waiting for their flush, together. One memtable is a fifth of it
    /// (fjall makes writers wait while four wait for their flush). Default
    /// `WRITE_BUFFER_BYTES_DEFAULT` (5 MiB), at least
    /// `WRITE_BUFFER_BYTES_MIN` (4 MiB). Smaller means less memory and
    /// more, smaller table files (more compaction work). It applies at
    /// every open, whatever the store was created or last opened with.
    pub fn write_buffer_bytes(mut self, bytes: u64) -> Self {
        self.write_buffer_bytes = bytes.max(WRITE_BUFFER_BYTES_MIN);
        self
    }
    /// How long idempotency keys are remembered (rule I5; default 100,000
    /// keys per tenant and 24 hours). Bounds below 1 are raised to 1.
    ///
    /// ```
    /// use agentstate::{IdempotencyWindow, Options};
    /// let opts = Options::new().idempotency_window(IdempotencyWindow {
    ///     keys_max: 10_000,
    ///     ttl_millis: 60 * 60 * 1000,
    /// });
    /// # let _ = opts;
    /// ```
    pub fn idempotency_window(mut self, window: IdempotencyWindow) -> Self {
        self.idempotency = IdempotencyWindow {
            keys_max: window.keys_max.max(1),
            ttl_millis: window.ttl_millis.max(1),
        };
        self
    }
    /// Whether a clean close (the last handle dropped, every write synced)
    /// flushes the memtables into tables and removes the journal they made
    /// redundant, so the next open has no journal to replay (fjall engine;
    /// sled ignores it). Default `true`: the close then takes one flush
    /// (tens of milliseconds for a full memtable), and the next open
    /// milliseconds instead of a replay of the journal (up to the write
    /// buffer's worth; ~16 ms per MB on a small machine). `false`
    /// closes at once and leaves the journal for the next open. A close
    /// after a failed write, or whose flush fails, leaves the journal as it
    /// is either way.
    pub fn flush_at_close(mut self, flush: bool) -> Self {
        self.flush_at_close = flush;
        self
    }

    /// What the fjall engine is opened with.
    pub fn tuning(&self) -> Tuning {
        Tuning {
            cache_bytes: self.cache_bytes,
            write_buffer_bytes: self.write_buffer_bytes,
            flush_at_close: self.flush_at_close,
        }
    }
}

/// How much the fjall engine may hold in memory, and what a clean close
/// does (from [`Options`]; the file engine is opened with it).
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// The block cache, bytes.
    pub cache_bytes: u64,
    /// All memtables together (the active one and those waiting to be
    /// flushed), bytes; one memtable is a fifth of it.
    pub write_buffer_bytes: u64,
    /// Flush at a clean close and remove the journals it made redundant.
    pub flush_at_close: bool,
}
