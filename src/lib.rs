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
// Operating errors are handled, never unwrapped, outside tests: each
// remaining `expect` states the invariant that makes it unreachable.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

// The layers are crates of their own (ARCHITECTURE.md): this facade
// re-exports them and adds the async face.
#[doc(hidden)]
pub mod fuzz_api;
pub use agentstate_core::limits;

#[cfg(feature = "async")]
mod async_store;
#[cfg(feature = "async")]
mod async_stream;

pub use agentstate_core::{
    ALARM_TRAY, Alarm, Amount, Approval, BudgetKey, BudgetRecord, BudgetStatus, BudgetStore,
    CapLimit, CapScope, Caps, Change, ChangePage, Changed, Clock, Cursor, Durability, Entry,
    FEED_WAIT_MAX, FeedScope, FeedStore, FileEngine, Hold, HoldRecord, IdempotencyKey,
    IdempotencyWindow, InstanceKey, Label, Labels, ManualClock, MarkedTray, Millis, Missing,
    Options, Page, PageRequest, Pages, PersistenceReason, Position, REDACTED, RecordKey, Result,
    RetryPolicy, RunKey, RunRecord, RunSpend, RunState, Scrubber, SessionKey, SessionRecord,
    Settled, Spend, StateDelta, StateError, StateQuery, StateStore, StateStoreExt, Store,
    StoreAdmin, StoreStats, SystemClock, TenantStats, ToolCall, Tray, TrayFilter, TrayKey, TrayOp,
    TrayStore, UpgradeProgress, Usage, VerifyReport, redact_connection_string,
};
pub use agentstate_kv::{FileStore, MemoryStore};

#[cfg(feature = "async")]
pub use async_store::AsyncStore;
#[cfg(feature = "async")]
pub use async_stream::{ChangeStream, PageStream};

#[cfg(feature = "conformance")]
#[doc(inline)]
pub use agentstate_conformance as conformance;
#[cfg(feature = "conformance")]
pub use agentstate_conformance::conformance_tests;
#[cfg(feature = "conformance")]
#[doc(hidden)]
pub use agentstate_conformance::{__conformance_rules, __conformance_test_fns};

#[cfg(feature = "postgres")]
pub use agentstate_postgres::{PgOptions, PostgresStore};
#[cfg(feature = "redis")]
pub use agentstate_redis::{RedisOptions, RedisStore};

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
