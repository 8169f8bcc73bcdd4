//! Idempotency keys (rules I1–I7): what every backend shares.
//!
//! A keyed write is applied at most once per key. The store keeps, beside
//! the write and in the same atomic step, what the call answered (the
//! record, hold or settlement, or the refusal it decided) and a
//! fingerprint of its arguments; a repeat of the key answers that outcome
//! again and writes nothing. A key used again with other arguments is
//! `Invalid`. How each backend keeps them is its own (a table of the
//! engine, a SQL table, a Redis hash); the key, the fingerprint, the
//! outcome and its encoding are written once, here.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::budget::{CapLimit, Hold, HoldRecord, Settled};
use crate::error::{RecordKey, Result, StateError};
use crate::limits::IDEMPOTENCY_KEY_BYTES_MAX;
use crate::record::{Millis, RunKey, RunRecord, StateDelta};
use crate::tray::{InstanceKey, TrayOp};

/// The caller's name for one logical write, kept across its retries: a
/// UUID per operation, say, or an id the caller already has (the tool
/// call's id, the step of a workflow). 1..=128 bytes of UTF-8
/// ([`IDEMPOTENCY_KEY_BYTES_MAX`]).
///
/// A write that carries one (`patch_run_idempotent`, `reserve_idempotent`,
/// …) is applied at most once: a retry with the same key, after any
/// failure, answers what the first call answered and writes nothing (rule
/// I1). Keys are scoped by tenant (trays: by instance namespace) and kept
/// for the store's [`IdempotencyWindow`](crate::IdempotencyWindow).
///
/// ```
/// use agentstate::{IdempotencyKey, MemoryStore, RunKey, RunRecord, StateDelta, StateStore};
/// let store = MemoryStore::new();
/// let run = store.put_run(RunRecord::new(RunKey::new("acme", "run_1"), "planner"))?;
/// let key = IdempotencyKey::new("call-7f3a")?;
/// let spend = StateDelta { cost_micros: 1_200, ..Default::default() };
/// let first = store.patch_run_idempotent(&run.key, spend, &key)?;
/// // The reply was lost, say: the retry answers the same record, adds nothing.
/// let again = store.patch_run_idempotent(&run.key, spend, &key)?;
/// assert_eq!(first, again);
/// assert_eq!(store.get_run(&run.key)?.unwrap().cost_micros, 1_200);
/// # Ok::<(), agentstate::StateError>(())
/// ```
///
/// In JSON it is its text; reading one checks its length as
/// [`IdempotencyKey::new`] does.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String")]
pub struct IdempotencyKey(String);

impl TryFrom<String> for IdempotencyKey {
    type Error = StateError;
    fn try_from(key: String) -> Result<Self> {
        IdempotencyKey::new(key)
    }
}

impl IdempotencyKey {
    /// A key from the caller's text: 1..=128 bytes, else `Invalid`.
    pub fn new(key: impl Into<String>) -> Result<Self> {
        let key = key.into();
        if key.is_empty() || key.len() > IDEMPOTENCY_KEY_BYTES_MAX {
            return Err(StateError::invalid(format!(
                "idempotency key: 1..={IDEMPOTENCY_KEY_BYTES_MAX} bytes, got {}",
                key.len()
            )));
        }
        Ok(IdempotencyKey(key))
    }

    /// A fresh key nobody else holds (128 random bits as 32 hex digits),
    /// for a caller that has no id of its own for the operation. Keep it
    /// with the operation until it has an answer.
    pub fn random() -> Self {
        use chacha20poly1305::aead::OsRng;
        use chacha20poly1305::aead::rand_core::RngCore;
        let mut bytes = [0u8; 16];
        OsRng.fill_bytes(&mut bytes);
        IdempotencyKey(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which write a key was first used for (part of its fingerprint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    PutRun = 1,
    PatchRun = 2,
    Reserve = 3,
    Settle = 4,
    ReleaseHold = 5,
    ApplyBatch = 6,
}

/// Where a key lives: a tenant's runs and budgets, or the trays of an
/// instance namespace (trays have no tenant).
#[derive(Debug, Clone, Copy)]
pub enum Scope<'a> {
    Tenant(&'a str),
    Trays(&'a str),
}

impl Scope<'_> {
    /// 1 for a tenant, 2 for an instance namespace.
    pub fn kind(&self) -> u8 {
        match self {
            Scope::Tenant(_) => 1,
            Scope::Trays(_) => 2,
        }
    }
    pub fn name(&self) -> &str {
        match self {
            Scope::Tenant(s) | Scope::Trays(s) => s,
        }
    }
}

/// One keyed call: where its key lives, the key, the fingerprint of its
/// operation and arguments, and the record it is about (which a
/// remembered refusal names when it is answered again).
#[derive(Debug, Clone)]
pub struct Keyed<'a> {
    pub scope: Scope<'a>,
    pub key: &'a IdempotencyKey,
    pub fingerprint: [u8; 16],
    pub about: RecordKey,
}

/// Domain separation of the fingerprint.
const FINGERPRINT_LABEL: &[u8] = b"agentstate idempotency v1";

impl<'a> Keyed<'a> {
    /// `args` are the call's arguments as the caller gave them (before the
    /// store's clock or scrubbing touched them), so a retry of the same
    /// call always has the same fingerprint.
    pub fn new(
        op: Op,
        scope: Scope<'a>,
        key: &'a IdempotencyKey,
        about: RecordKey,
        args: &impl Serialize,
    ) -> Result<Self> {
        let bytes = postcard::to_stdvec(args)
            .map_err(|e| StateError::invalid(format!("idempotent call arguments: {e}")))?;
        let mut h = Sha256::new();
        h.update(FINGERPRINT_LABEL);
        h.update([op as u8]);
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
        let digest = h.finalize();
        let mut fingerprint = [0u8; 16];
        fingerprint.copy_from_slice(&digest[..16]);
        Ok(Keyed {
            scope,
            key,
            fingerprint,
            about,
        })
    }
}

/// One constructor per keyed write, so every backend fingerprints a call
/// from the same operation, scope and arguments (a key first used on one
/// backend's process is recognised by another's).
impl<'a> Keyed<'a> {
    /// `put_run_idempotent`: the record as given, in its tenant.
    pub fn put_run(tenant: &'a str, record: &RunRecord, key: &'a IdempotencyKey) -> Result<Self> {
        let about = RecordKey::Run(record.key.clone());
        Keyed::new(Op::PutRun, Scope::Tenant(tenant), key, about, record)
    }
    /// `patch_run_idempotent`.
    pub fn patch_run(run: &'a RunKey, delta: &StateDelta, key: &'a IdempotencyKey) -> Result<Self> {
        let about = RecordKey::Run(run.clone());
        Keyed::new(
            Op::PatchRun,
            Scope::Tenant(&run.tenant),
            key,
            about,
            &(run, delta),
        )
    }
    /// `reserve_idempotent`.
    pub fn reserve(run: &'a RunKey, hold: &Hold, key: &'a IdempotencyKey) -> Result<Self> {
        let about = RecordKey::Run(run.clone());
        Keyed::new(
            Op::Reserve,
            Scope::Tenant(&run.tenant),
            key,
            about,
            &(run, hold),
        )
    }
    /// `settle_idempotent`.
    pub fn settle(
        run: &'a RunKey,
        hold_id: &str,
        spent: &StateDelta,
        key: &'a IdempotencyKey,
    ) -> Result<Self> {
        Keyed::new(
            Op::Settle,
            Scope::Tenant(&run.tenant),
            key,
            RecordKey::Run(run.clone()),
            &(run, hold_id, spent),
        )
    }
    /// `release_hold_idempotent`.
    pub fn release_hold(run: &'a RunKey, hold_id: &str, key: &'a IdempotencyKey) -> Result<Self> {
        Keyed::new(
            Op::ReleaseHold,
            Scope::Tenant(&run.tenant),
            key,
            RecordKey::Run(run.clone()),
            &(run, hold_id),
        )
    }
    /// `apply_batch_idempotent`, scoped by the instance's namespace.
    pub fn apply_batch(
        instance: &'a InstanceKey,
        epoch: u64,
        ops: &[TrayOp],
        key: &'a IdempotencyKey,
    ) -> Result<Self> {
        Keyed::new(
            Op::ApplyBatch,
            Scope::Trays(&instance.ns),
            key,
            RecordKey::Instance(instance.clone()),
            &(instance, epoch, ops),
        )
    }
}

/// What a keyed call answered the first time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Run(RunRecord),
    Hold(HoldRecord),
    Settled(Settled),
    Done,
    Refused(Refusal),
}

/// A refusal the store decided from its state, remembered with its key so
/// a repeat answers it again (the same facts, not a fresh decision).
///
/// The record a refusal is about is not kept: it is the keyed call's own
/// ([`Keyed::about`]), given back when the refusal is answered again. So
/// this encoding is the one earlier releases wrote, and their remembered
/// refusals read back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refusal {
    Conflict {
        expected: u64,
        actual: u64,
    },
    NotFound(RecordKey),
    InUse(Vec<RunKey>),
    FenceLost {
        caller: u64,
        stored: u64,
    },
    BudgetExceeded {
        limit: CapLimit,
        spent: u64,
        held: u64,
        asked: u64,
    },
    Invalid(String),
    TooLarge(String),
}

impl Refusal {
    /// The refusals a key remembers. Failures that left the store as it
    /// was for reasons outside it (unavailable, an unknown outcome, a
    /// damaged value) are not: the retry runs the call again.
    pub fn of(e: &StateError) -> Option<Self> {
        use crate::error::PersistenceReason as R;
        Some(match e {
            StateError::Conflict {
                expected, actual, ..
            } => Refusal::Conflict {
                expected: *expected,
                actual: *actual,
            },
            StateError::NotFound(m) => Refusal::NotFound(m.clone()),
            StateError::InUse { runs, .. } => Refusal::InUse(runs.clone()),
            StateError::FenceLost { caller, stored, .. } => Refusal::FenceLost {
                caller: *caller,
                stored: *stored,
            },
            StateError::BudgetExceeded {
                limit,
                spent,
                held,
                asked,
            } => Refusal::BudgetExceeded {
                limit: limit.clone(),
                spent: *spent,
                held: *held,
                asked: *asked,
            },
            StateError::Invalid { what } => Refusal::Invalid(what.clone()),
            StateError::Persistence {
                reason: R::TooLarge,
                detail,
                ..
            } => Refusal::TooLarge(detail.clone()),
            _ => return None,
        })
    }

    /// The refusal as the error it was, about `about` (the keyed call's
    /// record).
    pub fn into_error(self, about: &RecordKey) -> StateError {
        match self {
            Refusal::Conflict { expected, actual } => StateError::Conflict {
                record: about.clone(),
                expected,
                actual,
            },
            Refusal::NotFound(m) => StateError::NotFound(m),
            Refusal::InUse(runs) => StateError::InUse {
                record: about.clone(),
                runs,
            },
            Refusal::FenceLost { caller, stored } => {
                let instance = match about {
                    RecordKey::Instance(i) => i.clone(),
                    RecordKey::Tray(t) => t.instance(),
                    other => {
                        return StateError::corrupt(format!(
                            "an idempotency key remembers a lost fence for {other}, which has no epoch"
                        ));
                    }
                };
                StateError::FenceLost {
                    instance,
                    caller,
                    stored,
                }
            }
            Refusal::BudgetExceeded {
                limit,
                spent,
                held,
                asked,
            } => StateError::BudgetExceeded {
                limit,
                spent,
                held,
                asked,
            },
            Refusal::Invalid(what) => StateError::Invalid { what },
            Refusal::TooLarge(detail) => StateError::too_large(detail),
        }
    }
}

/// The answers of keyed calls: each kind round-trips through [`Outcome`].
pub trait Answer: Sized {
    fn outcome(&self) -> Outcome;
    fn from_outcome(o: Outcome) -> Option<Self>;
}

impl Answer for RunRecord {
    fn outcome(&self) -> Outcome {
        Outcome::Run(self.clone())
    }
    fn from_outcome(o: Outcome) -> Option<Self> {
        match o {
            Outcome::Run(r) => Some(r),
            _ => None,
        }
    }
}

impl<T: Answer> Answer for Box<T> {
    fn outcome(&self) -> Outcome {
        (**self).outcome()
    }
    fn from_outcome(o: Outcome) -> Option<Self> {
        T::from_outcome(o).map(Box::new)
    }
}

impl Answer for HoldRecord {
    fn outcome(&self) -> Outcome {
        Outcome::Hold(self.clone())
    }
    fn from_outcome(o: Outcome) -> Option<Self> {
        match o {
            Outcome::Hold(h) => Some(h),
            _ => None,
        }
    }
}

impl Answer for Settled {
    fn outcome(&self) -> Outcome {
        Outcome::Settled(self.clone())
    }
    fn from_outcome(o: Outcome) -> Option<Self> {
        match o {
            Outcome::Settled(s) => Some(s),
            _ => None,
        }
    }
}

impl Answer for () {
    fn outcome(&self) -> Outcome {
        Outcome::Done
    }
    fn from_outcome(o: Outcome) -> Option<Self> {
        match o {
            Outcome::Done => Some(()),
            _ => None,
        }
    }
}

/// The outcome a keyed call's answer leaves with its key, if any: every
/// success, and the refusals [`Refusal::of`] keeps.
pub fn outcome_of<T: Answer>(answer: &Result<T>) -> Option<Outcome> {
    match answer {
        Ok(v) => Some(v.outcome()),
        Err(e) => Refusal::of(e).map(Outcome::Refused),
    }
}

/// What a store keeps per key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remembered {
    /// The key's fingerprint (its operation and arguments).
    pub fingerprint: [u8; 16],
    /// When the first call committed, by the store's clock.
    pub at: Millis,
    /// The backend's own order of keys within a scope, for pruning (0
    /// where the backend orders by something else).
    pub ordinal: u64,
    pub outcome: Outcome,
}

impl Remembered {
    /// The first outcome again, for a repeat of the call with this
    /// `fingerprint` and `key`, about `about` (I1); a key first used with
    /// other arguments or for another operation is `Invalid` (I3).
    pub fn replay<T: Answer>(
        self,
        fingerprint: [u8; 16],
        key: &IdempotencyKey,
        about: &RecordKey,
    ) -> Result<T> {
        if self.fingerprint != fingerprint {
            return Err(reused(key));
        }
        match self.outcome {
            Outcome::Refused(r) => Err(r.into_error(about)),
            o => T::from_outcome(o).ok_or_else(|| reused(key)),
        }
    }
}

/// The refusal of a key used again for another call.
pub fn reused(key: &IdempotencyKey) -> StateError {
    StateError::invalid(format!(
        "idempotency key {key:?}: already used for another operation or other arguments; \
         use a new key for a new operation"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::StateDelta;

    #[test]
    fn fingerprints_tell_operations_and_arguments_apart() {
        let k = IdempotencyKey::new("k").unwrap();
        let run = RunKey::new("acme", "r");
        let d1 = StateDelta {
            cost_micros: 1,
            ..Default::default()
        };
        let d2 = StateDelta {
            cost_micros: 2,
            ..Default::default()
        };
        let about = || RecordKey::Run(run.clone());
        let tenant = Scope::Tenant("acme");
        let a = Keyed::new(Op::PatchRun, tenant, &k, about(), &(&run, &d1)).unwrap();
        let b = Keyed::new(Op::PatchRun, tenant, &k, about(), &(&run, &d1)).unwrap();
        let c = Keyed::new(Op::PatchRun, tenant, &k, about(), &(&run, &d2)).unwrap();
        let d = Keyed::new(Op::Settle, tenant, &k, about(), &(&run, &d1)).unwrap();
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_ne!(a.fingerprint, c.fingerprint);
        assert_ne!(a.fingerprint, d.fingerprint);
    }
    #[test]
    fn keys_are_1_to_128_bytes_and_random_ones_differ() {
        assert!(IdempotencyKey::new("").is_err());
        assert!(IdempotencyKey::new("x".repeat(IDEMPOTENCY_KEY_BYTES_MAX)).is_ok());
        assert!(IdempotencyKey::new("x".repeat(IDEMPOTENCY_KEY_BYTES_MAX + 1)).is_err());
        assert_ne!(IdempotencyKey::random(), IdempotencyKey::random());
        assert_eq!(IdempotencyKey::random().as_str().len(), 32);
    }

    #[test]
    fn a_remembered_refusal_replays_as_the_same_error() {
        let k = IdempotencyKey::new("k").unwrap();
        let run = RecordKey::Run(RunKey::new("t", "r"));
        let keyed = Keyed::new(Op::PutRun, Scope::Tenant("t"), &k, run.clone(), &1u8).unwrap();
        let e = StateError::Conflict {
            record: run.clone(),
            expected: 3,
            actual: 4,
        };
        let r = Remembered {
            fingerprint: keyed.fingerprint,
            at: 0,
            ordinal: 0,
            outcome: outcome_of::<RunRecord>(&Err(e)).unwrap(),
        };
        let again = r
            .clone()
            .replay::<RunRecord>(keyed.fingerprint, &k, &keyed.about)
            .unwrap_err();
        assert!(
            matches!(
                &again,
                StateError::Conflict {
                    record,
                    expected: 3,
                    actual: 4
                } if *record == run
            ),
            "{again:?}"
        );
        let other = Keyed::new(Op::PutRun, Scope::Tenant("t"), &k, run.clone(), &2u8).unwrap();
        assert!(matches!(
            r.replay::<RunRecord>(other.fingerprint, &k, &other.about),
            Err(StateError::Invalid { .. })
        ));
        assert!(
            outcome_of::<RunRecord>(&Err(StateError::unavailable("down", None))).is_none(),
            "an unavailable store's failure is not remembered"
        );
    }

    /// The record a refusal names is the keyed call's, not part of what is
    /// kept: a refusal is stored in the bytes earlier releases wrote (so
    /// their remembered refusals still read), and answers again naming
    /// the call's record.
    #[test]
    fn remembered_refusals_keep_their_encoding_and_name_the_calls_record() {
        let conflict = Outcome::Refused(Refusal::Conflict {
            expected: 3,
            actual: 4,
        });
        // Outcome::Refused is variant 4, Refusal::Conflict variant 0.
        assert_eq!(postcard::to_stdvec(&conflict).unwrap(), [4, 0, 3, 4]);
        let fence = Outcome::Refused(Refusal::FenceLost {
            caller: 1,
            stored: 2,
        });
        assert_eq!(postcard::to_stdvec(&fence).unwrap(), [4, 3, 1, 2]);
        // RecordKey's variants keep Missing's order: Hold is still 4.
        let hold = Outcome::Refused(Refusal::NotFound(RecordKey::Hold {
            run: RunKey::new("t", "r"),
            hold_id: "h".into(),
        }));
        assert_eq!(
            postcard::to_stdvec(&hold).unwrap(),
            [4, 1, 4, 1, b't', 1, b'r', 1, b'h']
        );

        let instance = InstanceKey::new("pinned", "w1");
        let Outcome::Refused(r) = postcard::from_bytes::<Outcome>(&[4, 3, 1, 2]).unwrap() else {
            panic!("not a refusal")
        };
        let e = r.clone().into_error(&RecordKey::Instance(instance.clone()));
        assert!(
            matches!(&e, StateError::FenceLost { instance: i, caller: 1, stored: 2 } if *i == instance),
            "{e:?}"
        );
        let tray = instance.tray("state", "main");
        assert!(matches!(
            r.clone().into_error(&RecordKey::Tray(tray)),
            StateError::FenceLost { instance: i, .. } if i == instance
        ));
        // A lost fence remembered for a run's call cannot be: a run has no
        // epoch, so the kept value is damaged.
        assert!(matches!(
            r.into_error(&RecordKey::Run(RunKey::new("t", "r"))),
            StateError::Corrupt { .. }
        ));
    }
}
