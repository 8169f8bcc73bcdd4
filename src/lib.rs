//! # agentstate
//!
//! Durable state for AI-agent runtimes: runs, sessions and the trays of
//! pinned workers, kept so that a crashed or stale worker can never silently
//! overwrite, double-spend or lose another worker's work.
//!
//! - Every write states the version it read ([`StateError::Conflict`] when
//!   it moved); spend accumulates through commuting patches
//!   ([`StateStore::patch_run`]).
//! - Spend caps hold under concurrency: [`BudgetStore::reserve`] checks a
//!   run's and its budget's caps and records the hold in one atomic step;
//!   [`BudgetStore::settle`] records what was spent (module docs of
//!   [`BudgetStore`] show the reserve → call → settle pattern).
//! - Every tray operation carries the caller's epoch, and a stale holder gets
//!   [`StateError::FenceLost`] with nothing changed.
//! - Tool-call arguments are scrubbed of secrets on every write.
//! - Every data type (records, keys, queries, pages, reports, errors) is
//!   serde `Serialize` and `Deserialize` with a stable JSON shape
//!   (docs/guide.md, "JSON shapes"); errors name the record they are about.
//!
//! The backends: [`MemoryStore`] (in the process, for tests) and
//! [`FileStore`] (one directory on disk, the embedded default; an `Ok`
//! means the write was synced) share one implementation of these rules;
//! `PostgresStore` (feature `postgres`) keeps them across the processes of
//! a fleet on one PostgreSQL server (an `Ok` means the transaction
//! committed with `synchronous_commit = on`), and `RedisStore` (feature
//! `redis`) on one Redis server. All pass one conformance suite.
//!
//! ```
//! use agentstate::{MemoryStore, RunKey, RunRecord, StateDelta, StateStore};
//! let store = MemoryStore::new();
//! let run = store.put_run(RunRecord::new(RunKey::new("acme", "run_1"), "planner"))?;
//! assert_eq!(run.version, 1);
//! let run = store.patch_run(&run.key, StateDelta { cost_micros: 1_200, ..Default::default() })?;
//! assert_eq!((run.version, run.cost_micros), (2, 1_200));
//! # Ok::<(), agentstate::StateError>(())
//! ```
//!
//! ## Feature flags
//! None is on by default: [`MemoryStore`] and [`FileStore`] need none, and
//! a library that depends on this crate pulls in no command-line or server
//! client code it did not ask for.
//! - `async`: `AsyncStore`, a tokio wrapper that runs blocking work on
//!   `spawn_blocking`.
//! - `conformance`: `agentstate::conformance`, the public conformance suite
//!   a third-party backend runs against itself (one macro line:
//!   `agentstate::conformance_tests!(factory)`).
//! - `postgres`: `PostgresStore` and `PgOptions`, the PostgreSQL backend
//!   (async-native: `tokio-postgres` with a `deadpool` pool, the sync API
//!   a wait on the same futures; TLS on rustls with libpq's `sslmode`).
//! - `redis`: `RedisStore` and `RedisOptions`, the Redis backend (every
//!   write one Lua script on the server, over redis-rs' async client, so
//!   `AsyncStore` awaits it natively; `rediss://` on rustls; an `Ok`
//!   survives a server crash only with `appendfsync always`, and nothing
//!   is safe from eviction but `noeviction`, which `connect` checks).
//! - `sled`: the sled engine under the file store
//!   (`Options::engine(FileEngine::Sled)`), kept as a second engine the
//!   conformance suite and the crash harness run on.
//!
//! The command-line tool (`agentstate demo`, `runs list`, `verify`,
//! `export`/`import`, `copy` between backends) is the `agentstate-cli`
//! crate: `cargo install agentstate-cli` builds it with every backend.
//!
//! ## The contract
//! The numbered rules every backend keeps are in the repository's
//! `docs/CONTRACT.md`; each is a test of the conformance suite named after
//! its id (`r3_…`, `l7_…`).
//!
//! ## Durability
//! See [`Durability`] and docs/durability.md.

// No unsafe code in this crate (the engines under vendor/ are fjall's).
#![forbid(unsafe_code)]
// Every public item is documented; the docs are part of the contract.
#![warn(missing_docs)]
// docs.rs (`--cfg docsrs`) marks each item with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
// Operating errors are handled, never unwrapped, outside tests.
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

mod admin;
mod api;
mod budget;
mod clock;
mod codec;
#[cfg(feature = "conformance")]
pub mod conformance;
mod cursor;
mod entry;
mod error;
mod feed;
#[doc(hidden)]
pub mod fuzz_api;
mod idempotency;
mod kv;
mod labels;
pub mod limits;
#[cfg(any(feature = "postgres", feature = "redis"))]
pub(crate) mod native;
mod observe;
mod options;
mod page;
#[cfg(feature = "postgres")]
mod pg;
mod record;
mod redact;
#[cfg(feature = "redis")]
mod redis_store;
mod retry;
mod rules;
mod scrub;
mod scrub_prefilter;
pub(crate) mod sync;
mod tray;

#[cfg(feature = "async")]
mod async_store;
#[cfg(feature = "async")]
mod async_stream;

pub use admin::{StoreAdmin, StoreStats, TenantStats, VerifyReport};
pub use api::{StateStore, Store, TrayStore};
#[cfg(feature = "async")]
pub use async_store::AsyncStore;
#[cfg(feature = "async")]
pub use async_stream::{ChangeStream, PageStream};
pub use budget::{
    Amount, BudgetKey, BudgetRecord, BudgetStatus, BudgetStore, CapLimit, CapScope, Caps, Hold,
    HoldRecord, RunSpend, Settled, Spend,
};
pub use clock::{Clock, ManualClock, SystemClock};
pub use cursor::Cursor;
pub use entry::Entry;
pub use error::{Missing, PersistenceReason, RecordKey, Result, StateError};
pub use feed::{Change, ChangePage, Changed, FEED_WAIT_MAX, FeedScope, FeedStore, Position};
pub use idempotency::IdempotencyKey;
pub use kv::{FileStore, MemoryStore};
pub use labels::{Label, Labels};
pub use options::{Durability, FileEngine, IdempotencyWindow, Options, UpgradeProgress};
pub use page::{Page, PageRequest, Pages};
#[cfg(feature = "postgres")]
pub use pg::{PgOptions, PostgresStore};
pub use record::{
    Approval, Millis, RunKey, RunRecord, RunState, SessionKey, SessionRecord, StateDelta,
    StateQuery, ToolCall, Usage,
};
pub use redact::redact_connection_string;
#[cfg(feature = "redis")]
pub use redis_store::{RedisOptions, RedisStore};
pub use retry::{RetryPolicy, StateStoreExt};
pub use scrub::{REDACTED, Scrubber};
pub use tray::{ALARM_TRAY, Alarm, InstanceKey, MarkedTray, Tray, TrayFilter, TrayKey, TrayOp};

// The README's and the manual's (docs/) examples run as doctests, so they
// cannot drift from the code.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/guide.md")]
struct GuideDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/python.md")]
struct PythonDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/cli.md")]
struct CliDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/postgres.md")]
struct PostgresDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/redis.md")]
struct RedisDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/async.md")]
struct AsyncDoctests;
#[cfg(doctest)]
#[doc = include_str!("../docs/durability.md")]
struct DurabilityDoctests;
