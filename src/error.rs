//! The one error type of the crate.

use std::path::PathBuf;

use crate::budget::{BudgetKey, CapLimit};
use crate::record::{RunKey, SessionKey};
use crate::tray::TrayKey;

/// Why a write could not be persisted (rule E3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum PersistenceReason {
    /// The write certainly did not apply: the store could not be reached,
    /// refused it before anything was written (a full disk, a store
    /// refusing writes after an earlier failure, a server shutting down),
    /// or rolled it back. Retryable: wait or reopen, then try again.
    Unavailable,
    /// The write was sent and may have applied: the connection was lost
    /// after the server was asked to commit (or to run the write's script),
    /// or the file store's sync failed after its journal write. Reading
    /// cannot always tell (a patch leaves no trace of itself).
    ///
    /// Retryable only when the call carried an idempotency key (`keyed`):
    /// the retry with the same key answers the first outcome if the write
    /// had applied and applies it if it had not (rules I1, I7). Without a
    /// key, a retry of a patch, reserve or settle may apply twice: read,
    /// and decide.
    OutcomeUnknown {
        /// The call carried an idempotency key.
        keyed: bool,
    },
    /// The record or doc is larger than the store's limit. Not retryable: the
    /// record stays too large.
    TooLarge,
    /// The file system holding the store is read-only (`EROFS`). Not
    /// retryable: remount it read-write, or use another path.
    ReadOnly,
    /// A server answered "no" to how it was asked: authentication or
    /// authorization failed, TLS was required or refused, the database
    /// does not exist, or it runs with a setting under which the store
    /// could lose acknowledged writes (an eviction policy, no
    /// persistence). Not retryable: retrying repeats the same answer;
    /// fix the configuration. The detail carries the server's own words;
    /// `source()` the driver's error.
    Refused,
    /// The file system refuses the store's path itself: a file name too long
    /// for it (`ENAMETOOLONG`), a component that is not a directory, or a name
    /// it cannot hold. Not retryable: pick another path.
    InvalidPath,
}

impl PersistenceReason {
    /// The reason an I/O error of this kind gives: read-only file systems
    /// and unusable paths are not retryable; everything else (a full disk,
    /// a failed sync, an interrupted call) is `Unavailable`.
    pub fn of_io(e: &std::io::Error) -> Self {
        use std::io::ErrorKind as K;
        match e.kind() {
            K::ReadOnlyFilesystem => PersistenceReason::ReadOnly,
            K::InvalidFilename | K::NotADirectory => PersistenceReason::InvalidPath,
            _ => PersistenceReason::Unavailable,
        }
    }
}

/// What a [`StateError::NotFound`] could not find (rule E2).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
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
        /// Unavailable (retryable), OutcomeUnknown (retryable when keyed), or
        /// TooLarge, ReadOnly, InvalidPath, Refused (not).
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
    /// The store at this path is already open (D3): in another process, or
    /// (`this_process`) through another handle of this one.
    #[error(
        "store {} is already open {}",
        path.display(),
        if *this_process { "in this process (drop the other handle first)" } else { "in another process" }
    )]
    Locked {
        /// The store's path.
        path: PathBuf,
        /// True when this process holds it (another open handle).
        this_process: bool,
    },
}

impl StateError {
    /// True only for failures where trying the same call again is safe and
    /// can succeed: `Persistence { reason: Unavailable }`, and
    /// `Persistence { reason: OutcomeUnknown { keyed: true } }` (a retry
    /// with the same idempotency key never applies twice).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            StateError::Persistence {
                reason: PersistenceReason::Unavailable
                    | PersistenceReason::OutcomeUnknown { keyed: true },
                ..
            }
        )
    }

    /// True when the failed call may have applied (an outcome lost in
    /// transit or a failed sync after the write): see
    /// [`PersistenceReason::OutcomeUnknown`].
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(
            self,
            StateError::Persistence {
                reason: PersistenceReason::OutcomeUnknown { .. },
                ..
            }
        )
    }

    /// A write whose outcome is unknown: sent, and maybe applied.
    pub(crate) fn outcome_unknown(
        detail: impl Into<String>,
        source: Option<std::io::Error>,
    ) -> Self {
        StateError::Persistence {
            reason: PersistenceReason::OutcomeUnknown { keyed: false },
            detail: detail.into(),
            source,
        }
    }

    /// The error as a keyed call answers it: an unknown outcome of a call
    /// that carried an idempotency key is retryable (rule I7).
    pub(crate) fn keyed(self) -> Self {
        match self {
            StateError::Persistence {
                reason: PersistenceReason::OutcomeUnknown { .. },
                detail,
                source,
            } => StateError::Persistence {
                reason: PersistenceReason::OutcomeUnknown { keyed: true },
                detail,
                source,
            },
            other => other,
        }
    }

    /// The variant's name in snake case: the JSON shape's `kind`, and the
    /// `kind` label of the error metrics.
    pub(crate) fn kind_name(&self) -> &'static str {
        match self {
            StateError::Conflict { .. } => "conflict",
            StateError::NotFound(_) => "not_found",
            StateError::Persistence { .. } => "persistence",
            StateError::InUse { .. } => "in_use",
            StateError::FenceLost { .. } => "fence_lost",
            StateError::BudgetExceeded { .. } => "budget_exceeded",
            StateError::Invalid { .. } => "invalid",
            StateError::Corrupt { .. } => "corrupt",
            StateError::UnsupportedFormat { .. } => "unsupported_format",
            StateError::Locked { .. } => "locked",
        }
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

    /// A server's "no" to the configuration (see
    /// [`PersistenceReason::Refused`]), with the driver's error as source.
    #[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
    pub(crate) fn refused(
        detail: impl Into<String>,
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        StateError::Persistence {
            reason: PersistenceReason::Refused,
            detail: detail.into(),
            source: source.map(std::io::Error::other),
        }
    }

    pub(crate) fn unavailable(detail: impl Into<String>, source: Option<std::io::Error>) -> Self {
        StateError::Persistence {
            reason: PersistenceReason::Unavailable,
            detail: detail.into(),
            source,
        }
    }

    /// An I/O error while `doing` something: its reason from its kind
    /// ([`PersistenceReason::of_io`]), the detail saying what was being done
    /// and what the OS said (once), and the error itself as `source()`.
    pub(crate) fn io(doing: impl std::fmt::Display, e: std::io::Error) -> Self {
        StateError::Persistence {
            reason: PersistenceReason::of_io(&e),
            detail: format!("{doing}: {e}"),
            source: Some(e),
        }
    }

    /// The same error again, for each caller of a failed commit group: the
    /// same variant and text, and a `source()` of the same kind and OS code.
    pub(crate) fn replicate(&self) -> StateError {
        use StateError as E;
        match self {
            E::Conflict { expected, actual } => E::Conflict {
                expected: *expected,
                actual: *actual,
            },
            E::NotFound(m) => E::NotFound(m.clone()),
            E::Persistence {
                reason,
                detail,
                source,
            } => E::Persistence {
                reason: *reason,
                detail: detail.clone(),
                source: source.as_ref().map(|io| match io.raw_os_error() {
                    Some(code) => std::io::Error::from_raw_os_error(code),
                    None => std::io::Error::new(io.kind(), io.to_string()),
                }),
            },
            E::InUse { runs } => E::InUse { runs: runs.clone() },
            E::FenceLost { caller, stored } => E::FenceLost {
                caller: *caller,
                stored: *stored,
            },
            E::BudgetExceeded {
                limit,
                spent,
                held,
                asked,
            } => E::BudgetExceeded {
                limit: limit.clone(),
                spent: *spent,
                held: *held,
                asked: *asked,
            },
            E::Invalid { what } => E::Invalid { what: what.clone() },
            E::Corrupt { what } => E::Corrupt { what: what.clone() },
            E::UnsupportedFormat { found, supported } => E::UnsupportedFormat {
                found: *found,
                supported: *supported,
            },
            E::Locked { path, this_process } => E::Locked {
                path: path.clone(),
                this_process: *this_process,
            },
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = StateError> = std::result::Result<T, E>;

/// A stable JSON shape for HTTP APIs and logs:
/// `{"kind": "conflict", "message": "…", "retryable": false, …facts}`,
/// the facts being the variant's fields (`expected`/`actual`,
/// `caller`/`stored`, `missing`, `runs`, `limit`/`spent`/`held`/`asked`,
/// `reason`/`detail`, `what`, `found`/`supported`, `path`/`this_process`).
/// `kind` is the variant's name in snake case. New variants add new kinds.
impl serde::Serialize for StateError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        let kind = self.kind_name();
        m.serialize_entry("kind", kind)?;
        m.serialize_entry("message", &self.to_string())?;
        m.serialize_entry("retryable", &self.is_retryable())?;
        match self {
            StateError::Conflict { expected, actual } => {
                m.serialize_entry("expected", expected)?;
                m.serialize_entry("actual", actual)?;
            }
            StateError::NotFound(missing) => m.serialize_entry("missing", missing)?,
            StateError::Persistence { reason, detail, .. } => {
                m.serialize_entry("reason", reason)?;
                m.serialize_entry("detail", detail)?;
            }
            StateError::InUse { runs } => m.serialize_entry("runs", runs)?,
            StateError::FenceLost { caller, stored } => {
                m.serialize_entry("caller", caller)?;
                m.serialize_entry("stored", stored)?;
            }
            StateError::BudgetExceeded {
                limit,
                spent,
                held,
                asked,
            } => {
                m.serialize_entry("limit", limit)?;
                m.serialize_entry("spent", spent)?;
                m.serialize_entry("held", held)?;
                m.serialize_entry("asked", asked)?;
            }
            StateError::Invalid { what } | StateError::Corrupt { what } => {
                m.serialize_entry("what", what)?
            }
            StateError::UnsupportedFormat { found, supported } => {
                m.serialize_entry("found", found)?;
                m.serialize_entry("supported", supported)?;
            }
            StateError::Locked { path, this_process } => {
                m.serialize_entry("path", &path.display().to_string())?;
                m.serialize_entry("this_process", this_process)?;
            }
        }
        m.end()
    }
}
