//! The core of [agentstate](https://docs.rs/agentstate): what every backend
//! shares and no backend owns.
//!
//! - the records, keys, queries, pages, errors and limits of the public API;
//! - the traits a backend implements ([`StateStore`], [`TrayStore`],
//!   [`BudgetStore`], [`StoreAdmin`], [`FeedStore`]; [`Store`] is all five);
//! - the rules decided in Rust, once for every backend (`rules`), the
//!   value and key codecs, and the scrubber;
//! - with the `native` feature, the async core a server backend implements
//!   once (`native::AsyncCore`) and the bridge its synchronous calls wait on.
//!
//! Users depend on the `agentstate` facade, which re-exports this crate's
//! public items; the backends (`agentstate-kv`, `agentstate-postgres`,
//! `agentstate-redis`) depend on this crate and on no other backend. Modules
//! marked hidden are the backends' shared plumbing, not a stable API.

// No unsafe code in this crate.
#![forbid(unsafe_code)]
// Every public item is documented; the docs are part of the contract.
#![warn(missing_docs)]
// docs.rs (`--cfg docsrs`) marks each item with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
// Operating errors are handled, never unwrapped, outside tests: each
// remaining `expect` states the invariant that makes it unreachable.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

#[doc(hidden)]
pub mod admin;
#[doc(hidden)]
pub mod api;
#[doc(hidden)]
pub mod budget;
#[doc(hidden)]
pub mod calls;
#[doc(hidden)]
pub mod clock;
#[doc(hidden)]
pub mod codec;
#[doc(hidden)]
pub mod cursor;
#[doc(hidden)]
pub mod entry;
#[doc(hidden)]
pub mod error;
#[doc(hidden)]
pub mod feed;
#[doc(hidden)]
pub mod idempotency;
#[doc(hidden)]
pub mod labels;
pub mod limits;
#[cfg(feature = "native")]
#[doc(hidden)]
pub mod native;
#[doc(hidden)]
pub mod observe;
#[doc(hidden)]
pub mod options;
#[doc(hidden)]
pub mod page;
#[doc(hidden)]
pub mod record;
#[doc(hidden)]
pub mod redact;
#[doc(hidden)]
pub mod retry;
#[doc(hidden)]
pub mod rules;
#[doc(hidden)]
pub mod scrub;
#[doc(hidden)]
pub mod scrub_prefilter;
#[doc(hidden)]
pub mod tray;

pub use admin::{StoreAdmin, StoreStats, TenantStats, VerifyReport};
pub use api::{StateStore, Store, TrayStore};
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
pub use labels::{Label, Labels};
pub use options::{Durability, FileEngine, IdempotencyWindow, Options, UpgradeProgress};
pub use page::{Page, PageRequest, Pages};
pub use record::{
    Approval, Millis, RunKey, RunRecord, RunState, SessionKey, SessionRecord, StateDelta,
    StateQuery, ToolCall, Usage,
};
pub use redact::redact_connection_string;
pub use retry::{RetryPolicy, StateStoreExt};
pub use scrub::{REDACTED, Scrubber};
pub use tray::{ALARM_TRAY, Alarm, InstanceKey, MarkedTray, Tray, TrayFilter, TrayKey, TrayOp};
