//! Idempotency keys on the engine (rules I1–I6): a keyed job reads its
//! key first and answers the remembered outcome, or runs and leaves its
//! outcome beside its writes, in the same commit group.
//!
//! Tables (`kv::key::table`): `IDEM` holds each key's [`Remembered`];
//! `IDEM_ORDER` a scope's keys oldest first; `IDEM_SCOPE` the scope's next
//! ordinal and how many keys it keeps. Each keyed write forgets up to
//! `IDEMPOTENCY_PRUNE_MAX` of its scope's oldest keys that are past the
//! window (older than its ttl, or beyond its count), so the tables stay
//! bounded without a sweeper. Export leaves the keys out: a store built by
//! import starts with none.

use super::KvStore;
use super::commit::Txn;
use crate::key::table;
use agentstate_core::codec::key::{KeyBuf, prefix_end};
use agentstate_core::codec::value;
use agentstate_core::error::{Result, StateError};
use agentstate_core::idempotency::{Answer, Keyed, Remembered, outcome_of};
use agentstate_core::limits::IDEMPOTENCY_PRUNE_MAX;
use agentstate_core::options::IdempotencyWindow;
use agentstate_core::record::Millis;

/// A keyed job's key, owned so it can travel to the commit leader.
struct Owned {
    kind: u8,
    scope: String,
    key: agentstate_core::IdempotencyKey,
    fingerprint: [u8; 16],
    about: agentstate_core::error::RecordKey,
}

impl Owned {
    fn idem_key(&self) -> Vec<u8> {
        KeyBuf::table(table::IDEM)
            .u8(self.kind)
            .str(&self.scope)
            .str(self.key.as_str())
            .done()
    }
}

impl KvStore {
    /// Runs the write job `f`, under `keyed`'s idempotency key when there
    /// is one: a key already kept answers its remembered outcome and
    /// writes nothing (I1, I3); otherwise `f` runs, and its answer (every
    /// success, and the refusals that are remembered) is kept with the
    /// key in the same group as `f`'s writes, a refusal without them.
    /// Same-key calls are serialized by the committer, so two of them at
    /// once get one application and the same answer (I6).
    pub(crate) fn submit_keyed<T, F>(&self, keyed: Option<Keyed<'_>>, f: F) -> Result<T>
    where
        T: Answer + Send + 'static,
        F: FnOnce(&mut Txn<'_>) -> Result<T> + Send + 'static,
    {
        let Some(k) = keyed else {
            return self.submit(f);
        };
        let owned = Owned {
            kind: k.scope.kind(),
            scope: k.scope.name().to_owned(),
            key: k.key.clone(),
            fingerprint: k.fingerprint,
            about: k.about,
        };
        let now = self.now();
        let window = self.opts.idempotency;
        let answer = self.submit(move |txn| {
            let at = owned.idem_key();
            if let Some(v) = txn.get(&at)? {
                let kept: Remembered = value::decode(&v, "idempotency key")?;
                return Ok(kept.replay(owned.fingerprint, &owned.key, &owned.about));
            }
            let seq = txn.next_seq;
            let answer = f(txn);
            let Some(outcome) = outcome_of(&answer) else {
                // Not remembered: nothing of the job is kept.
                return answer.map(Ok);
            };
            if answer.is_err() {
                txn.discard_writes();
                txn.next_seq = seq;
            }
            remember(txn, &owned, at, outcome, now, window)?;
            Ok(answer)
        });
        answer.and_then(|a| a).map_err(StateError::keyed)
    }
}

/// Keeps `outcome` under the key, after forgetting what of the scope is
/// past the window.
fn remember(
    txn: &mut Txn<'_>,
    k: &Owned,
    at: Vec<u8>,
    outcome: agentstate_core::idempotency::Outcome,
    now: Millis,
    window: IdempotencyWindow,
) -> Result<()> {
    let scope_key = KeyBuf::table(table::IDEM_SCOPE)
        .u8(k.kind)
        .str(&k.scope)
        .done();
    let (next, mut kept): (u64, u64) = match txn.get(&scope_key)? {
        Some(v) => value::decode(&v, "idempotency scope")?,
        None => (1, 0),
    };
    let order = KeyBuf::table(table::IDEM_ORDER)
        .u8(k.kind)
        .str(&k.scope)
        .done();
    for (ok, ov) in txn.scan(&order, &prefix_end(&order), IDEMPOTENCY_PRUNE_MAX)? {
        let (key, first): (String, Millis) = value::decode(&ov, "idempotency order")?;
        let expired = first.saturating_add(window.ttl_millis) <= now;
        if !(expired || kept >= window.keys_max) {
            break;
        }
        txn.delete(ok);
        txn.delete(
            KeyBuf::table(table::IDEM)
                .u8(k.kind)
                .str(&k.scope)
                .str(&key)
                .done(),
        );
        kept = kept.saturating_sub(1);
    }
    let remembered = Remembered {
        fingerprint: k.fingerprint,
        at: now,
        ordinal: next,
        outcome,
    };
    txn.put(at, value::encode(&remembered));
    txn.put(
        KeyBuf::table(table::IDEM_ORDER)
            .u8(k.kind)
            .str(&k.scope)
            .u64(next)
            .done(),
        value::encode(&(k.key.as_str(), now)),
    );
    txn.put(scope_key, value::encode(&(next + 1, kept + 1)));
    Ok(())
}
