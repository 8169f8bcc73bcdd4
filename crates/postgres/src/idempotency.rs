//! Idempotency keys on PostgreSQL (rules I1–I7): a keyed call claims its
//! key, runs, and keeps its outcome beside its writes, in one transaction.
//!
//! Tables (`schema/v3.sql`): `agentstate_idempotency` holds each key's
//! fingerprint and [`Remembered`] outcome; `agentstate_idempotency_scopes`
//! each scope's next ordinal and how many keys it keeps.
//!
//! A keyed transaction:
//!
//! 1. claims the key: `INSERT … ON CONFLICT DO NOTHING`. A call racing
//!    with the same key waits on the first one's uncommitted row; when
//!    that commits, its insert does nothing and it reads the row and
//!    answers the remembered outcome (I1, I3, I6); when that rolls back,
//!    its insert goes ahead and it runs.
//! 2. `SAVEPOINT`, then the call itself.
//! 3. keeps the answer: every success with its writes; a remembered
//!    refusal (`outcome_of`) after `ROLLBACK TO SAVEPOINT`, so without
//!    them; any other failure rolls the whole transaction back, claim and
//!    all, and a retry runs again.
//! 4. locks its scope's row (the last lock it takes, so no cycle), forgets
//!    up to `IDEMPOTENCY_PRUNE_MAX` of the scope's oldest keys that are
//!    past the window (older than its ttl by the store's clock, or beyond
//!    `keys_max` kept), and numbers its own key: exactly as the engine
//!    stores do (`kv::idempotency`).

use agentstate_core::codec::value;
use agentstate_core::error::{Result, StateError};
use agentstate_core::idempotency::{Answer, Keyed, Outcome, Remembered, outcome_of};
use agentstate_core::limits::IDEMPOTENCY_PRUNE_MAX;
use agentstate_core::options::IdempotencyWindow;
use agentstate_core::record::Millis;

use super::conn::{Fail, Tx, TxResult, params};
use super::{Col, PostgresStore, id_in, num, num_out};

/// Where a key's row is, as stored (escaped like every id).
struct At {
    kind: i16,
    scope: String,
    key: String,
}

/// A keyed call's key, where its row is, and the store's window.
pub(crate) struct KeyedTxn<'k> {
    keyed: Keyed<'k>,
    at: At,
    now: Millis,
    window: IdempotencyWindow,
}

impl<'k> KeyedTxn<'k> {
    pub(crate) fn new(store: &PostgresStore, k: Keyed<'k>) -> Self {
        KeyedTxn {
            at: At {
                kind: i16::from(k.scope.kind()),
                scope: id_in(k.scope.name()).into_owned(),
                key: id_in(k.key.as_str()).into_owned(),
            },
            keyed: k,
            now: store.now(),
            window: store.opts.options.idempotency,
        }
    }

    /// Step 1: claims the key, or answers what it remembers.
    pub(crate) async fn claim<T: Answer>(&self, tx: &mut Tx<'_>) -> TxResult<Option<Result<T>>> {
        Ok(claim(tx, &self.at, &self.keyed.fingerprint, self.now)
            .await?
            .map(|kept| kept.replay(self.keyed.fingerprint, self.keyed.key, &self.keyed.about)))
    }

    /// Step 3 and 4, after the call's own `answer` (step 2).
    pub(crate) async fn keep<T: Answer>(
        &self,
        tx: &mut Tx<'_>,
        answer: TxResult<T>,
    ) -> TxResult<Result<T>> {
        let answer = match answer {
            Ok(v) => Ok(v),
            Err(Fail::Rule(e)) => Err(e),
            // A server failure: the transaction loop decides (tried
            // again from the claim, or Unavailable).
            Err(other) => return Err(other),
        };
        let Some(outcome) = outcome_of(&answer) else {
            // Not remembered: nothing of the call is kept, its claim
            // neither (the whole transaction rolls back).
            return answer.map(Ok).map_err(Fail::Rule);
        };
        if answer.is_err() {
            // The refused call's deferred writes never go out, and what
            // it sent is undone.
            tx.discard();
            tx.batch("ROLLBACK TO SAVEPOINT agentstate_keyed").await?;
        }
        remember(
            tx,
            &self.at,
            self.keyed.fingerprint,
            outcome,
            self.now,
            self.window,
        )
        .await?;
        Ok(answer)
    }
}

/// [`txn!`](super::conn::txn) under a keyed call's idempotency key when
/// there is one (`Option<Keyed>`; see the module). A keyed call's unknown
/// outcome is retryable (`StateError::keyed`).
macro_rules! txn_keyed {
    ($store:expr, $keyed:expr, |$tx:ident| $body:expr) => {{
        let store: &$crate::PostgresStore = $store;
        match $keyed {
            None => $crate::conn::txn!(store, |$tx| $body),
            Some(k) => {
                let ctx = $crate::idempotency::KeyedTxn::new(store, k);
                $crate::conn::txn!(store, |keyed_tx| {
                    if let Some(kept) = ctx.claim(keyed_tx).await? {
                        return Ok(kept);
                    }
                    keyed_tx.defer_batch("SAVEPOINT agentstate_keyed");
                    let answer = {
                        let $tx = &mut *keyed_tx;
                        $crate::conn::typed(async { $body }).await
                    };
                    ctx.keep(keyed_tx, answer).await
                })
                .and_then(|a| a)
                .map_err(agentstate_core::error::StateError::keyed)
            }
        }
    }};
}
pub(crate) use txn_keyed;

/// Claims the key for this transaction (`None`), or reads what it
/// remembers (`Some`), waiting for a racing call that holds it.
async fn claim(
    tx: &mut Tx<'_>,
    at: &At,
    fingerprint: &[u8; 16],
    now: Millis,
) -> TxResult<Option<Remembered>> {
    let fingerprint: &[u8] = fingerprint;
    // A key pruned between the insert and the read is claimed again; a
    // few rounds are plenty (pruning takes only keys past the window).
    for _ in 0..4 {
        let claimed = tx
            .execute(
                "INSERT INTO {s}agentstate_idempotency (kind, scope, key, fingerprint, created_at) \
             VALUES ($1, $2, $3, $4, $5::text::numeric) \
             ON CONFLICT (kind, scope, key) DO NOTHING",
                &[&at.kind, &at.scope, &at.key, &fingerprint, &num(now)],
            )
            .await?;
        if claimed == 1 {
            return Ok(None);
        }
        let rows = tx
            .query(
                "SELECT outcome FROM {s}agentstate_idempotency \
             WHERE kind = $1 AND scope = $2 AND key = $3",
                &[&at.kind, &at.scope, &at.key],
            )
            .await?;
        if let Some(row) = rows.first() {
            let bytes: Option<&[u8]> = row.col(0)?;
            let bytes = bytes.ok_or_else(|| {
                StateError::corrupt("agentstate_idempotency: a committed key has no outcome")
            })?;
            return Ok(Some(value::decode(bytes, "idempotency key")?));
        }
    }
    Err(StateError::unavailable(
        "postgres: an idempotency key kept vanishing while it was claimed; try again",
        None,
    )
    .into())
}

/// Keeps `outcome` under the claimed key, after forgetting what of the
/// scope is past the window.
async fn remember(
    tx: &mut Tx<'_>,
    at: &At,
    fingerprint: [u8; 16],
    outcome: Outcome,
    now: Millis,
    window: IdempotencyWindow,
) -> TxResult<()> {
    // The scope's row, locked until commit: ordinals follow commit order
    // and every prune of the scope is serialized, so `kept` stays exact.
    let rows = tx
        .query(
            "INSERT INTO {s}agentstate_idempotency_scopes AS c (kind, scope, next_ordinal, kept) \
         VALUES ($1, $2, 2, 0) \
         ON CONFLICT (kind, scope) DO UPDATE SET next_ordinal = c.next_ordinal + 1 \
         RETURNING next_ordinal - 1, kept",
            &[&at.kind, &at.scope],
        )
        .await?;
    let ordinal: i64 = rows[0].col(0)?;
    let mut kept: i64 = rows[0].col(1)?;
    // The oldest kept keys (this call's own has no ordinal yet).
    let oldest = tx
        .query(
            "SELECT key, created_at::text FROM {s}agentstate_idempotency \
         WHERE kind = $1 AND scope = $2 AND ordinal IS NOT NULL ORDER BY ordinal LIMIT $3",
            &[&at.kind, &at.scope, &(IDEMPOTENCY_PRUNE_MAX as i64)],
        )
        .await?;
    let mut gone: Vec<String> = Vec::new();
    for row in &oldest {
        let first = num_out(row.col(1)?, "agentstate_idempotency.created_at")?;
        let expired = first.saturating_add(window.ttl_millis) <= now;
        if !(expired || u64::try_from(kept).unwrap_or(0) >= window.keys_max) {
            break;
        }
        gone.push(row.col(0)?);
        kept = (kept - 1).max(0);
    }
    let remembered = Remembered {
        fingerprint,
        at: now,
        ordinal: u64::try_from(ordinal).unwrap_or(0),
        outcome,
    };
    let bytes = value::encode(&remembered);
    // The last write: it goes out with the COMMIT.
    tx.defer(
        "WITH gone AS ( \
             DELETE FROM {s}agentstate_idempotency \
             WHERE kind = $1 AND scope = $2 AND key = ANY($3::text[])), \
         mine AS ( \
             UPDATE {s}agentstate_idempotency SET ordinal = $5, outcome = $6 \
             WHERE kind = $1 AND scope = $2 AND key = $4) \
         UPDATE {s}agentstate_idempotency_scopes SET kept = $7 \
         WHERE kind = $1 AND scope = $2",
        params![
            at.kind,
            at.scope.clone(),
            gone,
            at.key.clone(),
            ordinal,
            bytes,
            kept + 1,
        ],
    )
    .await?;
    Ok(())
}
