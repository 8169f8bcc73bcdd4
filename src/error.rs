//! The one error type of the crate.

use std::path::PathBuf;

use crate::budget::{BudgetKey, CapLimit};
use crate::record::{RunKey, SessionKey};
use crate::tray::TrayKey;

/// Why a write could not be persisted (rule E3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PersistenceReason {
    /// The store could not persist the write (a failed sync, a full disk, a
    /// store refusing writes after an earlier failure). Retryable: reopen or
    /// wait, then try again.
    Unavailable,
    /// The record or doc is larger than the store's limit. Not retryable: the
    /// record stays too large.
    TooLarge,
}

/// What a [`StateError::NotFound`] could not find (rule E2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    /// A run.
    Run(RunKey),
    /// A session.
    Session(SessionKey),
    /// A tray.
    Tray(TrayKey),
    /// A named tenant budget.
    Budget(BudgetKey),
    /// A live hold of a run (never reserved, or already settled, released
    /// or expired).
    Hold {
        /// The run.
        run: RunKey,
        /// The hold's id.
        hold_id: String,
    },
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Missing::Run(k) => write!(f, "run {}/{}", k.tenant, k.run_id),
            Missing::Session(k) => write!(f, "session {}/{}", k.tenant, k.session_id),
            Missing::Tray(k) => write!(f, "tray {}/{}/{}/{}", k.ns, k.id, k.tray_ns, k.tray_id),
            Missing::Budget(k) => write!(f, "budget {}/{}", k.tenant, k.name),
            Missing::Hold { run, hold_id } => {
                write!(f, "hold {hold_id} of run {}/{}", run.tenant, run.run_id)
            }
        }
    }
}

/// Every failure of every store, as data (rules E1–E6).
///
/// Nothing is ever partially applied: after any error the store reads
/// exactly as it did before the call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// The stored version is not the one the caller read (E1). Re-read and
    /// decide again; retrying the same record fails the same way.
    #[error("version conflict: expected {expected}, stored {actual}")]
    Conflict {
        /// The version the caller said it read.
        expected: u64,
        /// The version stored now (0 when the record does not exist).
        actual: u64,
    },
    /// The named record does not exist (E2).
    #[error("not found: {0}")]
    NotFound(Missing),
    /// The write could not be persisted (E3).
    #[error("persistence failed ({reason:?}): {detail}")]
    Persistence {
        /// Unavailable (retryable) or TooLarge (not).
        reason: PersistenceReason,
        /// What happened, for a human.
        detail: String,
        /// The I/O error underneath, when there is one.
        #[source]
        source: Option<std::io::Error>,
    },
    /// A session delete would orphan unfinished runs (E4).
    #[error("session has {} unfinished run(s)", runs.len())]
    InUse {
        /// Every unfinished run of the session.
        runs: Vec<RunKey>,
    },
    /// The caller's epoch is older than the stored one (E5); nothing changed.
    #[error("fence lost: caller epoch {caller} < stored epoch {stored}")]
    FenceLost {
        /// The epoch the caller carried.
        caller: u64,
        /// The epoch stored for the instance.
        stored: u64,
    },
    /// A reserve would take spend past a cap (B2); nothing changed. Not
    /// retryable as is: the cap stays until spend is released, a hold
    /// expires, or the cap is raised.
    #[error("{limit} exceeded: spent {spent} + held {held} + asked {asked}")]
    BudgetExceeded {
        /// Which cap refused: the run's or its budget's, and which amount.
        limit: CapLimit,
        /// Spent against that cap, as committed at the moment of the check.
        spent: u64,
        /// Held by live holds against it at that moment.
        held: u64,
        /// What the refused hold asked for.
        asked: u64,
    },
    /// Bad input (E6): which input, and why.
    #[error("invalid input: {what}")]
    Invalid {
        /// Which input and why it was refused.
        what: String,
    },
    /// The store's files are damaged, or hold a value that fails its check
    /// (D5, D8). Nothing was changed.
    #[error("store is corrupt: {what}")]
    Corrupt {
        /// What was found damaged.
        what: String,
    },
    /// The store was written by a newer release of this crate (D4). The
    /// files were not touched.
    #[error(
        "store format version {found} is newer than this build supports ({supported}); upgrade agentstate"
    )]
    UnsupportedFormat {
        /// The version found in the store.
        found: u8,
        /// The newest version this build reads.
        supported: u8,
    },
    /// Another process holds the store at this path (D3).
    #[error("store {} is already open in another process", path.display())]
    Locked {
        /// The store's path.
        path: PathBuf,
    },
}

impl StateError {
    /// True only for failures where trying the same call again can succeed:
    /// `Persistence { reason: Unavailable }`.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            StateError::Persistence {
                reason: PersistenceReason::Unavailable,
                ..
            }
        )
    }

    pub(crate) fn invalid(what: impl Into<String>) -> Self {
        StateError::Invalid { what: what.into() }
    }

    pub(crate) fn corrupt(what: impl Into<String>) -> Self {
        StateError::Corrupt { what: what.into() }
    }

    pub(crate) fn too_large(detail: impl Into<String>) -> Self {
        StateError::Persistence {
            reason: PersistenceReason::TooLarge,
            detail: detail.into(),
            source: None,
        }
    }

    pub(crate) fn unavailable(detail: impl Into<String>, source: Option<std::io::Error>) -> Self {
        StateError::Persistence {
            reason: PersistenceReason::Unavailable,
            detail: detail.into(),
            source,
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = StateError> = std::result::Result<T, E>;
