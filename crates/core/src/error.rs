//! The one error type of the crate.

use std::path::PathBuf;

use crate::budget::{BudgetKey, CapLimit};
use crate::record::{RunKey, SessionKey};
use crate::tray::{InstanceKey, TrayKey};

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

/// Which record an error is about: the key of a run, session, tray,
/// budget, hold or instance. [`StateError::NotFound`] names what it could
/// not find with it (rule E2), [`StateError::Conflict`] the record whose
/// version moved (E1), [`StateError::InUse`] the record a delete was
/// refused for (E4).
///
/// Displays as the kind of record and its key (`run acme/run_1`,
/// `hold h1 of run acme/run_1`); in JSON it is an object with one member
/// named after the kind (`{"run": {"tenant": "acme", "run_id": "run_1"}}`).
///
/// ```
/// use agentstate::{RecordKey, RunKey};
/// let k = RecordKey::Run(RunKey::new("acme", "run_1"));
/// assert_eq!(k.to_string(), "run acme/run_1");
/// assert_eq!(
///     serde_json::to_string(&k).unwrap(),
///     r#"{"run":{"tenant":"acme","run_id":"run_1"}}"#
/// );
/// ```
// The variants' order is part of the stores' encoding of the refusals an
// idempotency key remembers (postcard numbers variants): new kinds go at
// the end.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RecordKey {
    /// A run.
    Run(RunKey),
    /// A session.
    Session(SessionKey),
    /// A tray.
    Tray(TrayKey),
    /// A named tenant budget.
    Budget(BudgetKey),
    /// A hold of a run (for `NotFound`: never reserved, or already
    /// settled, released or expired).
    Hold {
        /// The run.
        run: RunKey,
        /// The hold's id.
        hold_id: String,
    },
    /// A pinned-worker instance (its epoch, its alarm).
    Instance(InstanceKey),
}

/// What a [`StateError::NotFound`] could not find: the name this type had
/// before it named the records of other errors too.
pub type Missing = RecordKey;

impl std::fmt::Display for RecordKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordKey::Run(k) => write!(f, "run {k}"),
            RecordKey::Session(k) => write!(f, "session {k}"),
            RecordKey::Tray(k) => write!(f, "tray {k}"),
            RecordKey::Budget(k) => write!(f, "budget {k}"),
            RecordKey::Hold { run, hold_id } => write!(f, "hold {hold_id} of run {run}"),
            RecordKey::Instance(k) => write!(f, "instance {k}"),
        }
    }
}

impl From<RunKey> for RecordKey {
    fn from(k: RunKey) -> Self {
        RecordKey::Run(k)
    }
}

impl From<SessionKey> for RecordKey {
    fn from(k: SessionKey) -> Self {
        RecordKey::Session(k)
    }
}

impl From<TrayKey> for RecordKey {
    fn from(k: TrayKey) -> Self {
        RecordKey::Tray(k)
    }
}

impl From<BudgetKey> for RecordKey {
    fn from(k: BudgetKey) -> Self {
        RecordKey::Budget(k)
    }
}

impl From<InstanceKey> for RecordKey {
    fn from(k: InstanceKey) -> Self {
        RecordKey::Instance(k)
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
    #[error("version conflict on {record}: expected {expected}, stored {actual}")]
    Conflict {
        /// The record whose version moved (for an import, the entry whose
        /// record already exists).
        record: RecordKey,
        /// The version the caller said it read.
        expected: u64,
        /// The version stored now (0 when the record does not exist).
        actual: u64,
    },
    /// The named record does not exist (E2).
    #[error("not found: {0}")]
    NotFound(RecordKey),
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
    /// A delete was refused because runs are unfinished (E4): a session
    /// delete that would orphan its unfinished runs, or a `delete_run`
    /// without a version of a run that has not finished (then `runs` is
    /// that run).
    #[error("{}", in_use_message(record, runs))]
    InUse {
        /// The record whose delete was refused: the session, or the run.
        record: RecordKey,
        /// Every unfinished run that blocks it.
        runs: Vec<RunKey>,
    },
    /// The caller's epoch is older than the stored one (E5); nothing changed.
    #[error("fence lost on instance {instance}: caller epoch {caller} < stored epoch {stored}")]
    FenceLost {
        /// The instance whose epoch moved past the caller's.
        instance: InstanceKey,
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
    /// A change feed no longer holds every tombstone after the position
    /// asked for (rule F6): they were pruned through `horizon`, or the
    /// scope's tenant was purged. Re-list the scope's current state, then
    /// follow the feed on from `horizon`.
    #[error(
        "the feed of {scope} was pruned through position {horizon}: re-list, then follow on from there"
    )]
    FeedPruned {
        /// Which feed.
        scope: crate::feed::FeedScope,
        /// The oldest position the feed can still be read after.
        horizon: crate::feed::Position,
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
    pub fn outcome_unknown(detail: impl Into<String>, source: Option<std::io::Error>) -> Self {
        StateError::Persistence {
            reason: PersistenceReason::OutcomeUnknown { keyed: false },
            detail: detail.into(),
            source,
        }
    }

    /// The error as a keyed call answers it: an unknown outcome of a call
    /// that carried an idempotency key is retryable (rule I7).
    pub fn keyed(self) -> Self {
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
    pub fn kind_name(&self) -> &'static str {
        match self {
            StateError::Conflict { .. } => "conflict",
            StateError::NotFound(_) => "not_found",
            StateError::Persistence { .. } => "persistence",
            StateError::InUse { .. } => "in_use",
            StateError::FenceLost { .. } => "fence_lost",
            StateError::BudgetExceeded { .. } => "budget_exceeded",
            StateError::FeedPruned { .. } => "feed_pruned",
            StateError::Invalid { .. } => "invalid",
            StateError::Corrupt { .. } => "corrupt",
            StateError::UnsupportedFormat { .. } => "unsupported_format",
            StateError::Locked { .. } => "locked",
        }
    }

    pub fn invalid(what: impl Into<String>) -> Self {
        StateError::Invalid { what: what.into() }
    }

    pub fn corrupt(what: impl Into<String>) -> Self {
        StateError::Corrupt { what: what.into() }
    }

    pub fn too_large(detail: impl Into<String>) -> Self {
        StateError::Persistence {
            reason: PersistenceReason::TooLarge,
            detail: detail.into(),
            source: None,
        }
    }

    /// A server's "no" to the configuration (see
    /// [`PersistenceReason::Refused`]), with the driver's error as source.
    pub fn refused(
        detail: impl Into<String>,
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        StateError::Persistence {
            reason: PersistenceReason::Refused,
            detail: detail.into(),
            source: source.map(std::io::Error::other),
        }
    }

    pub fn unavailable(detail: impl Into<String>, source: Option<std::io::Error>) -> Self {
        StateError::Persistence {
            reason: PersistenceReason::Unavailable,
            detail: detail.into(),
            source,
        }
    }

    /// An I/O error while `doing` something: its reason from its kind
    /// ([`PersistenceReason::of_io`]), the detail saying what was being done
    /// and what the OS said (once), and the error itself as `source()`.
    pub fn io(doing: impl std::fmt::Display, e: std::io::Error) -> Self {
        StateError::Persistence {
            reason: PersistenceReason::of_io(&e),
            detail: format!("{doing}: {e}"),
            source: Some(e),
        }
    }

    /// The same error again, for each caller of a failed commit group: the
    /// same variant and text, and a `source()` of the same kind and OS code.
    pub fn replicate(&self) -> StateError {
        use StateError as E;
        match self {
            E::Conflict {
                record,
                expected,
                actual,
            } => E::Conflict {
                record: record.clone(),
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
            E::InUse { record, runs } => E::InUse {
                record: record.clone(),
                runs: runs.clone(),
            },
            E::FenceLost {
                instance,
                caller,
                stored,
            } => E::FenceLost {
                instance: instance.clone(),
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
            E::FeedPruned { scope, horizon } => E::FeedPruned {
                scope: scope.clone(),
                horizon: *horizon,
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

/// How many runs an `InUse` message names before it says how many more.
const IN_USE_NAMED_MAX: usize = 10;

/// `session acme/s has 2 unfinished run(s): acme/r1, acme/r3`, or for a
/// `delete_run` refused for its own run, `run acme/r1 is unfinished`.
fn in_use_message(record: &RecordKey, runs: &[RunKey]) -> String {
    if let (RecordKey::Run(k), [only]) = (record, runs)
        && k == only
    {
        return format!("{record} is unfinished");
    }
    let mut names: Vec<String> = runs
        .iter()
        .take(IN_USE_NAMED_MAX)
        .map(|k| k.to_string())
        .collect();
    if runs.len() > IN_USE_NAMED_MAX {
        names.push(format!("and {} more", runs.len() - IN_USE_NAMED_MAX));
    }
    format!(
        "{record} has {} unfinished run(s): {}",
        runs.len(),
        names.join(", ")
    )
}

/// Shorthand for results of this crate.
pub type Result<T, E = StateError> = std::result::Result<T, E>;

/// The stable JSON shape, for HTTP APIs and logs: an object with the
/// variant's `kind` (its name in snake case), its `message` (the
/// `Display` text), whether it is `retryable`, and the variant's facts
/// under the names of its fields:
///
/// | kind | facts |
/// |---|---|
/// | `conflict` | `record`, `expected`, `actual` |
/// | `not_found` | `missing` |
/// | `persistence` | `reason`, `detail`, and `source` (the text of the error underneath) when there is one |
/// | `in_use` | `record`, `runs` |
/// | `fence_lost` | `instance`, `caller`, `stored` |
/// | `budget_exceeded` | `limit`, `spent`, `held`, `asked` |
/// | `feed_pruned` | `scope`, `horizon` |
/// | `invalid`, `corrupt` | `what` |
/// | `unsupported_format` | `found`, `supported` |
/// | `locked` | `path` (as text), `this_process` |
///
/// ```
/// use agentstate::{RecordKey, RunKey, StateError};
/// let e = StateError::Conflict {
///     record: RecordKey::Run(RunKey::new("acme", "run_1")),
///     expected: 3,
///     actual: 4,
/// };
/// assert_eq!(
///     serde_json::to_string(&e).unwrap(),
///     concat!(
///         r#"{"kind":"conflict","message":"version conflict on run acme/run_1: expected 3, stored 4","#,
///         r#""retryable":false,"record":{"run":{"tenant":"acme","run_id":"run_1"}},"expected":3,"actual":4}"#,
///     )
/// );
/// ```
///
/// New variants add new kinds, and a variant may gain facts (new members);
/// existing members keep their names and meaning.
impl serde::Serialize for StateError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        let kind = self.kind_name();
        m.serialize_entry("kind", kind)?;
        m.serialize_entry("message", &self.to_string())?;
        m.serialize_entry("retryable", &self.is_retryable())?;
        match self {
            StateError::Conflict {
                record,
                expected,
                actual,
            } => {
                m.serialize_entry("record", record)?;
                m.serialize_entry("expected", expected)?;
                m.serialize_entry("actual", actual)?;
            }
            StateError::NotFound(missing) => m.serialize_entry("missing", missing)?,
            StateError::Persistence {
                reason,
                detail,
                source,
            } => {
                m.serialize_entry("reason", reason)?;
                m.serialize_entry("detail", detail)?;
                if let Some(source) = source {
                    m.serialize_entry("source", &source.to_string())?;
                }
            }
            StateError::InUse { record, runs } => {
                m.serialize_entry("record", record)?;
                m.serialize_entry("runs", runs)?;
            }
            StateError::FenceLost {
                instance,
                caller,
                stored,
            } => {
                m.serialize_entry("instance", instance)?;
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
            StateError::FeedPruned { scope, horizon } => {
                m.serialize_entry("scope", scope)?;
                m.serialize_entry("horizon", horizon)?;
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

/// Every member the JSON shape of an error may have; which are required
/// depends on the `kind`.
#[derive(serde::Deserialize)]
struct ErrorJson {
    kind: String,
    // `message` and `retryable` follow from the facts: like any member
    // this release does not know (a fact a newer one added), they are
    // skipped.
    record: Option<RecordKey>,
    expected: Option<u64>,
    actual: Option<u64>,
    missing: Option<RecordKey>,
    reason: Option<PersistenceReason>,
    detail: Option<String>,
    source: Option<String>,
    runs: Option<Vec<RunKey>>,
    instance: Option<InstanceKey>,
    caller: Option<u64>,
    stored: Option<u64>,
    limit: Option<CapLimit>,
    spent: Option<u64>,
    held: Option<u64>,
    asked: Option<u64>,
    what: Option<String>,
    found: Option<u8>,
    supported: Option<u8>,
    path: Option<String>,
    this_process: Option<bool>,
    scope: Option<crate::feed::FeedScope>,
    horizon: Option<crate::feed::Position>,
}

/// Reads the shape [`Serialize`](serde::Serialize) writes back into the
/// error it was written from: the same variant, facts, `Display` text and
/// retryability. `message` and `retryable` are not read (they follow from
/// the facts). What cannot cross JSON as it was crosses as its text: a
/// `Persistence` error's `source` comes back as an `io::Error` of kind
/// `Other` with the same text, and a `Locked` path as the path its text
/// names. An unknown `kind` (from a newer release) is an error.
///
/// ```
/// use agentstate::{InstanceKey, StateError};
/// let json = r#"{"kind":"fence_lost","instance":{"ns":"pinned","id":"w1"},"caller":4,"stored":7}"#;
/// let e: StateError = serde_json::from_str(json).unwrap();
/// assert!(matches!(e, StateError::FenceLost { caller: 4, stored: 7, .. }));
/// assert_eq!(e.to_string(), "fence lost on instance pinned/w1: caller epoch 4 < stored epoch 7");
/// ```
impl<'de> serde::Deserialize<'de> for StateError {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let j = ErrorJson::deserialize(d)?;
        fn need<T, E: serde::de::Error>(
            v: Option<T>,
            kind: &str,
            field: &'static str,
        ) -> std::result::Result<T, E> {
            v.ok_or_else(|| E::custom(format!("a {kind} error needs `{field}`")))
        }
        let k = j.kind.as_str();
        Ok(match k {
            "conflict" => StateError::Conflict {
                record: need(j.record, k, "record")?,
                expected: need(j.expected, k, "expected")?,
                actual: need(j.actual, k, "actual")?,
            },
            "not_found" => StateError::NotFound(need(j.missing, k, "missing")?),
            "persistence" => StateError::Persistence {
                reason: need(j.reason, k, "reason")?,
                detail: need(j.detail, k, "detail")?,
                source: j.source.map(std::io::Error::other),
            },
            "in_use" => StateError::InUse {
                record: need(j.record, k, "record")?,
                runs: need(j.runs, k, "runs")?,
            },
            "fence_lost" => StateError::FenceLost {
                instance: need(j.instance, k, "instance")?,
                caller: need(j.caller, k, "caller")?,
                stored: need(j.stored, k, "stored")?,
            },
            "budget_exceeded" => StateError::BudgetExceeded {
                limit: need(j.limit, k, "limit")?,
                spent: need(j.spent, k, "spent")?,
                held: need(j.held, k, "held")?,
                asked: need(j.asked, k, "asked")?,
            },
            "feed_pruned" => StateError::FeedPruned {
                scope: need(j.scope, k, "scope")?,
                horizon: need(j.horizon, k, "horizon")?,
            },
            "invalid" => StateError::Invalid {
                what: need(j.what, k, "what")?,
            },
            "corrupt" => StateError::Corrupt {
                what: need(j.what, k, "what")?,
            },
            "unsupported_format" => StateError::UnsupportedFormat {
                found: need(j.found, k, "found")?,
                supported: need(j.supported, k, "supported")?,
            },
            "locked" => StateError::Locked {
                path: PathBuf::from(need(j.path, k, "path")?),
                this_process: need(j.this_process, k, "this_process")?,
            },
            other => {
                return Err(D::Error::custom(format!(
                    "unknown error kind {other:?} (written by a newer release?)"
                )));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_record() {
        let run = RunKey::new("acme", "r1");
        let conflict = StateError::Conflict {
            record: RecordKey::Run(run.clone()),
            expected: 3,
            actual: 4,
        };
        assert_eq!(
            conflict.to_string(),
            "version conflict on run acme/r1: expected 3, stored 4"
        );
        let fence = StateError::FenceLost {
            instance: InstanceKey::new("pinned", "w1"),
            caller: 4,
            stored: 7,
        };
        assert_eq!(
            fence.to_string(),
            "fence lost on instance pinned/w1: caller epoch 4 < stored epoch 7"
        );
        // A delete_run refused for its own run says so; a session names
        // its runs, ten at most.
        let own = StateError::InUse {
            record: RecordKey::Run(run.clone()),
            runs: vec![run.clone()],
        };
        assert_eq!(own.to_string(), "run acme/r1 is unfinished");
        let runs: Vec<RunKey> = (0..12)
            .map(|i| RunKey::new("acme", format!("r{i}")))
            .collect();
        let session = StateError::InUse {
            record: RecordKey::Session(SessionKey::new("acme", "s1")),
            runs,
        };
        assert_eq!(
            session.to_string(),
            "session acme/s1 has 12 unfinished run(s): acme/r0, acme/r1, acme/r2, acme/r3, \
             acme/r4, acme/r5, acme/r6, acme/r7, acme/r8, acme/r9, and 2 more"
        );
    }

    #[test]
    fn record_keys_display_their_kind_and_key() {
        let run = RunKey::new("acme", "r1");
        let i = InstanceKey::new("pinned", "w1");
        for (k, text) in [
            (RecordKey::Run(run.clone()), "run acme/r1"),
            (
                RecordKey::Session(SessionKey::new("acme", "s1")),
                "session acme/s1",
            ),
            (
                RecordKey::Tray(i.tray("state", "main")),
                "tray pinned/w1/state/main",
            ),
            (
                RecordKey::Budget(BudgetKey::new("acme", "monthly")),
                "budget acme/monthly",
            ),
            (
                RecordKey::Hold {
                    run,
                    hold_id: "h1".into(),
                },
                "hold h1 of run acme/r1",
            ),
            (RecordKey::Instance(i), "instance pinned/w1"),
        ] {
            assert_eq!(k.to_string(), text);
        }
    }
}
