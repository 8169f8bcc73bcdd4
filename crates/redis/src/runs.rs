//! Runs and sessions on Redis (rules R, S, L, X): the stored layouts, and
//! each write as one script call.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use agentstate_core::budget::{BudgetKey, Caps, HoldRecord, Spend};
use agentstate_core::codec::cursor::{self as cursor_codec, Listing};
use agentstate_core::codec::value::{self, FORMAT_VERSION};
use agentstate_core::error::{RecordKey, Result, StateError};
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{
    Approval, RunKey, RunRecord, RunState, SessionKey, SessionRecord, StateDelta, StateQuery,
    ToolCall, Usage,
};
use agentstate_core::rules::{
    check_id, check_limit, check_record, check_run_key, check_session_key, check_size,
};

use agentstate_core::idempotency::{IdempotencyKey, Keyed};
use agentstate_core::labels::Labels;

use super::connect::QueryOn;
use super::scripts::{
    DELETE_RUN, DELETE_SESSION, Idem, LIST_RUNS, PATCH_RUN, PUT_RUN, PUT_SESSION,
};
use super::{RedisStore, keys};

/// The fields of a run the caller gives, encoded by the client.
#[derive(Serialize)]
struct RunHeadRef<'a> {
    key: &'a RunKey,
    state: RunState,
    agent_name: &'a str,
    session_id: &'a Option<String>,
    pending_tool_calls: &'a [ToolCall],
    approval: &'a Option<Approval>,
    caps: &'a Caps,
    budget: &'a Option<String>,
}

#[derive(Deserialize)]
struct RunHead {
    key: RunKey,
    state: RunState,
    agent_name: String,
    session_id: Option<String>,
    pending_tool_calls: Vec<ToolCall>,
    approval: Option<Approval>,
    caps: Caps,
    budget: Option<String>,
}

/// The fields a script writes (postcard varints), after the head.
#[derive(Serialize, Deserialize)]
pub(super) struct RunTail {
    messages_read: u64,
    input_tokens: u64,
    output_tokens: u64,
    cost_micros: u64,
    iterations: u64,
    version: u64,
    created_at: u64,
    updated_at: u64,
    seq: u64,
}

#[derive(Deserialize)]
struct StoredRun {
    head: RunHead,
    tail: RunTail,
}

/// A run with labels (format [`FORMAT_LABELS`]): the head's fields, then
/// the labels, then the tail.
#[derive(Deserialize)]
struct StoredRunLabelled {
    head: RunHead,
    labels: Labels,
    tail: RunTail,
}

#[derive(Serialize)]
struct SessionHeadRef<'a> {
    key: &'a SessionKey,
    metadata: &'a BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize)]
struct SessionTail {
    version: u64,
    created_at: u64,
    updated_at: u64,
}

#[derive(Deserialize)]
struct StoredSession {
    key: SessionKey,
    metadata: BTreeMap<String, String>,
    tail: SessionTail,
}

/// A session with labels (format [`FORMAT_LABELS`]).
#[derive(Deserialize)]
struct StoredSessionLabelled {
    key: SessionKey,
    metadata: BTreeMap<String, String>,
    labels: Labels,
    tail: SessionTail,
}

/// The format of a run or session head that carries labels (rule R11):
/// the format-1 head's fields, then the labels (postcard: each key and the
/// value's canonical JSON text). Written only for a record with labels, so
/// a store that never uses them keeps format 1, byte for byte, and stays
/// readable by releases before them. This numbering is the Redis layout's
/// own (head and tail), apart from the engine stores' record formats.
pub(super) const FORMAT_LABELS: u8 = 2;

/// A head: the format byte and the postcard encoding of `v`, and its CRC.
pub(super) fn head<T: Serialize>(v: &T) -> (Vec<u8>, u32) {
    head_at(FORMAT_VERSION, v)
}

/// A head at `format`.
#[allow(clippy::expect_used, reason = "stored types always serialize")]
fn head_at<T: Serialize>(format: u8, v: &T) -> (Vec<u8>, u32) {
    // postcard's std serializer only fails on types serde cannot express.
    let h = postcard::to_extend(v, vec![format]).expect("stored types always serialize");
    let crc = agentstate_core::codec::crc::crc32(&h);
    (h, crc)
}

/// A whole value from its head and tail, as the scripts seal it (import).
pub(super) fn seal(head: &[u8], tail: &[u8]) -> Vec<u8> {
    let mut v = head.to_vec();
    v.extend_from_slice(tail);
    let crc = agentstate_core::codec::crc::crc32(&v);
    v.extend_from_slice(&crc.to_le_bytes());
    v
}

pub(super) fn run_head(r: &RunRecord) -> (Vec<u8>, u32) {
    let h = RunHeadRef {
        key: &r.key,
        state: r.state,
        agent_name: &r.agent_name,
        session_id: &r.session_id,
        pending_tool_calls: &r.pending_tool_calls,
        approval: &r.approval,
        caps: &r.caps,
        budget: &r.budget,
    };
    if r.labels.is_empty() {
        head(&h)
    } else {
        // postcard writes a tuple's fields in line: the head's, then the
        // labels.
        head_at(FORMAT_LABELS, &(h, &r.labels))
    }
}

#[allow(clippy::expect_used, reason = "stored types always serialize")]
pub(super) fn run_tail(r: &RunRecord) -> Vec<u8> {
    postcard::to_stdvec(&RunTail {
        messages_read: r.messages_read,
        input_tokens: r.usage.input_tokens,
        output_tokens: r.usage.output_tokens,
        cost_micros: r.cost_micros,
        iterations: r.iterations,
        version: r.version,
        created_at: r.created_at,
        updated_at: r.updated_at,
        seq: r.seq,
    })
    .expect("stored types always serialize")
}

pub(super) fn session_head(s: &SessionRecord) -> (Vec<u8>, u32) {
    let h = SessionHeadRef {
        key: &s.key,
        metadata: &s.metadata,
    };
    if s.labels.is_empty() {
        head(&h)
    } else {
        head_at(FORMAT_LABELS, &(h, &s.labels))
    }
}

#[allow(clippy::expect_used, reason = "stored types always serialize")]
pub(super) fn session_tail(s: &SessionRecord) -> Vec<u8> {
    postcard::to_stdvec(&SessionTail {
        version: s.version,
        created_at: s.created_at,
        updated_at: s.updated_at,
    })
    .expect("stored types always serialize")
}

/// Decodes and checks a stored run (format byte, CRC, its key).
pub(super) fn decode_run(bytes: &[u8], key: &RunKey) -> Result<RunRecord> {
    let r = decode_any_run(bytes)?;
    if &r.key != key {
        return Err(StateError::corrupt(format!(
            "run stored under {}/{} names another key",
            key.tenant, key.run_id
        )));
    }
    Ok(r)
}

/// Decodes a stored run of either format (format byte, CRC), whatever its
/// key.
fn decode_any_run(bytes: &[u8]) -> Result<RunRecord> {
    let (version, b) = value::checked(bytes, "run", FORMAT_LABELS)?;
    let (h, labels, t) = if version == FORMAT_LABELS {
        let s: StoredRunLabelled = value::body(b, "run")?;
        (s.head, s.labels, s.tail)
    } else {
        let s: StoredRun = value::body(b, "run")?;
        (s.head, Labels::new(), s.tail)
    };
    Ok(RunRecord {
        key: h.key,
        version: t.version,
        state: h.state,
        agent_name: h.agent_name,
        session_id: h.session_id,
        messages_read: t.messages_read,
        pending_tool_calls: h.pending_tool_calls,
        usage: Usage {
            input_tokens: t.input_tokens,
            output_tokens: t.output_tokens,
        },
        cost_micros: t.cost_micros,
        iterations: t.iterations,
        approval: h.approval,
        caps: h.caps,
        budget: h.budget,
        created_at: t.created_at,
        updated_at: t.updated_at,
        seq: t.seq,
        labels,
    })
}

pub(super) fn decode_session(bytes: &[u8], key: &SessionKey) -> Result<SessionRecord> {
    let (version, b) = value::checked(bytes, "session", FORMAT_LABELS)?;
    let s = if version == FORMAT_LABELS {
        value::body::<StoredSessionLabelled>(b, "session")?
    } else {
        let s: StoredSession = value::body(b, "session")?;
        StoredSessionLabelled {
            key: s.key,
            metadata: s.metadata,
            labels: Labels::new(),
            tail: s.tail,
        }
    };
    if &s.key != key {
        return Err(StateError::corrupt("session stored under another key"));
    }
    Ok(SessionRecord {
        key: s.key,
        version: s.tail.version,
        metadata: s.metadata,
        created_at: s.tail.created_at,
        updated_at: s.tail.updated_at,
        labels: s.labels,
    })
}

/// What a script answered: its first element names the outcome.
pub(super) type Reply = Vec<Vec<u8>>;

pub(super) fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub(super) fn num(b: &[u8], what: &str) -> Result<u64> {
    std::str::from_utf8(b)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| StateError::corrupt(format!("redis: {what} is not a number")))
}

/// The refusals every script may answer, as errors; `Ok(rest)` for `ok`.
/// `record` names the record the call is about (for a tray call, the tray
/// or its instance), for the errors that name it.
pub(super) fn outcome(
    reply: Reply,
    record: impl FnOnce() -> RecordKey,
    expected: u64,
) -> Result<Reply> {
    let mut it = reply.into_iter();
    let status = it.next().unwrap_or_default();
    let rest: Reply = it.collect();
    match status.as_slice() {
        b"ok" => Ok(rest),
        b"conflict" => Err(StateError::Conflict {
            record: record(),
            expected,
            actual: num(rest.first().map_or(&b""[..], |v| v), "stored version")?,
        }),
        b"notfound" => Err(StateError::NotFound(record())),
        b"fence" => {
            let stored = num(rest.first().map_or(&b""[..], |v| v), "stored epoch")?;
            let instance = match record() {
                RecordKey::Instance(i) => i,
                RecordKey::Tray(t) => t.instance(),
                other => {
                    return Err(StateError::corrupt(format!(
                        "redis: a lost fence answered for {other}, which has no epoch"
                    )));
                }
            };
            Err(StateError::FenceLost {
                instance,
                caller: expected,
                stored,
            })
        }
        b"invalid" => Err(StateError::invalid(text(
            rest.first().map_or(&b""[..], |v| v),
        ))),
        b"toolarge" => Err(StateError::too_large(format!(
            "record is {} bytes, the limit is",
            text(rest.first().map_or(&b""[..], |v| v))
        ))),
        other => Err(StateError::corrupt(format!(
            "redis: unexpected script answer {:?}",
            text(other)
        ))),
    }
}

impl RedisStore {
    /// A keyed call's idempotency arguments, at the store's clock.
    pub(super) fn idem(&self, keyed: Option<Keyed<'_>>) -> Option<Idem> {
        keyed.map(|k| Idem::new(&k, self.now(), self.opts.options.idempotency))
    }
}

/// The finished states (R9) as `put_run.lua` reads them: `tag:name,…`.
fn finished_tags() -> String {
    RunState::ALL
        .iter()
        .filter(|s| s.is_finished())
        .map(|s| format!("{}:{}", keys::state_tag(*s), s.as_str()))
        .collect::<Vec<_>>()
        .join(",")
}

/// Entries of an index one `list_runs` script call reads at most.
const LIST_SCAN_CAP: usize = 4096;

/// A script's `nobudget` answer (the budget name follows) as the error.
pub(super) fn no_budget(tenant: &str, reply: &Reply) -> StateError {
    let name = reply.get(1).map(|n| text(n)).unwrap_or_default();
    StateError::NotFound(RecordKey::Budget(BudgetKey::new(tenant, name)))
}

/// A run's caps as the scripts read them: 'cost tokens iterations', `-`
/// for no cap.
pub(super) fn caps_arg(c: &Caps) -> String {
    let f = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
    format!(
        "{} {} {}",
        f(c.cost_micros_max),
        f(c.tokens_max),
        f(c.iterations_max)
    )
}

impl RedisStore {
    /// A patch (`hold_id` None) or a settle of `hold_id`: the run after it
    /// and, for a settle, the hold it dropped.
    pub(super) async fn patch(
        &self,
        key: &RunKey,
        delta: &StateDelta,
        hold_id: Option<&str>,
        keyed: Option<Keyed<'_>>,
    ) -> Result<(RunRecord, Option<HoldRecord>)> {
        let idem = self.idem(keyed);
        let p = keys::tenant(&key.tenant);
        let max = self.max();
        let mut conn = self.conn().await?;
        self.writable(&mut conn).await?;

        let reply: Reply = PATCH_RUN
            .key(keys::run(&p, &key.run_id))
            .arg(self.now().to_string())
            .arg(delta.messages_read.to_string())
            .arg(delta.usage.input_tokens.to_string())
            .arg(delta.usage.output_tokens.to_string())
            .arg(delta.cost_micros.to_string())
            .arg(delta.iterations.to_string())
            .arg(max.to_string())
            .arg(&p)
            .arg(&key.run_id)
            .arg(hold_id.unwrap_or_default())
            .idem(idem.as_ref())
            .invoke(&mut conn)
            .await?;
        match reply.first().map(Vec::as_slice) {
            Some(b"nohold") => {
                return Err(StateError::NotFound(RecordKey::Hold {
                    run: key.clone(),
                    hold_id: hold_id.unwrap_or_default().to_string(),
                }));
            }
            Some(b"nobudget") => return Err(no_budget(&key.tenant, &reply)),
            _ => {}
        }
        let rest =
            outcome(reply, || RecordKey::Run(key.clone()), 0).map_err(|e| with_limit(e, max))?;
        let v = rest
            .first()
            .ok_or_else(|| StateError::corrupt("redis: patch_run answered no record"))?;
        let hold = match rest.get(1..6) {
            Some([c, t, i, ca, ea]) => Some(HoldRecord {
                id: hold_id.unwrap_or_default().to_string(),
                amounts: Spend {
                    cost_micros: num(c, "hold cost")?,
                    tokens: num(t, "hold tokens")?,
                    iterations: num(i, "hold iterations")?,
                },
                created_at: num(ca, "hold created_at")?,
                expires_at: num(ea, "hold expires_at")?,
            }),
            _ => None,
        };
        Ok((decode_run(v, key)?, hold))
    }
}

impl RedisStore {
    async fn put_run_with(&self, record: RunRecord, keyed: Option<Keyed<'_>>) -> Result<RunRecord> {
        check_record(&record)?;
        let idem = self.idem(keyed);
        let record = self.opts.options.scrubber.scrub_run_owned(record);
        let max = self.max();
        let (h, crc) = run_head(&record);
        check_size("run record", h.len() + value::OVERHEAD_BYTES - 1, max)?;
        let p = keys::tenant(&record.key.tenant);
        let session = record.session_id.clone().unwrap_or_default();
        let mut conn = self.conn().await?;
        self.writable(&mut conn).await?;
        self.register(&mut conn, &record.key.tenant).await?;
        let reply: Reply = PUT_RUN
            .key(keys::run(&p, &record.key.run_id))
            .key(keys::seq(&p))
            .key(keys::runs(&p))
            .key(keys::session(&p, &session))
            .key(keys::by_session(&p, &session))
            .arg(&p)
            .arg(&record.key.run_id)
            .arg(record.version.to_string())
            .arg(&h)
            .arg(crc.to_string())
            .arg(keys::state_tag(record.state))
            .arg(&session)
            .arg(&record.agent_name)
            .arg(self.now().to_string())
            .arg(record.messages_read.to_string())
            .arg(record.usage.input_tokens.to_string())
            .arg(record.usage.output_tokens.to_string())
            .arg(record.cost_micros.to_string())
            .arg(record.iterations.to_string())
            .arg(max.to_string())
            .arg(caps_arg(&record.caps))
            .arg(record.budget.clone().unwrap_or_default())
            .arg(finished_tags())
            .arg(record.state.as_str())
            .arg(keys::label_field(&record.labels))
            .idem(idem.as_ref())
            .invoke(&mut conn)
            .await?;
        if reply.first().map(Vec::as_slice) == Some(b"nosession") {
            return Err(StateError::NotFound(RecordKey::Session(SessionKey::new(
                record.key.tenant.clone(),
                session,
            ))));
        }
        if reply.first().map(Vec::as_slice) == Some(b"nobudget") {
            return Err(StateError::NotFound(RecordKey::Budget(BudgetKey::new(
                record.key.tenant.clone(),
                record.budget.clone().unwrap_or_default(),
            ))));
        }
        let rest = outcome(reply, || RecordKey::Run(record.key.clone()), record.version)
            .map_err(|e| with_limit(e, max))?;
        let v = rest
            .first()
            .ok_or_else(|| StateError::corrupt("redis: put_run answered no record"))?;
        decode_run(v, &record.key)
    }
}

impl RedisStore {
    pub(super) async fn put_run(&self, record: RunRecord) -> Result<RunRecord> {
        self.put_run_with(record, None).await
    }
    pub(super) async fn put_run_idempotent(
        &self,
        record: RunRecord,
        key: &IdempotencyKey,
    ) -> Result<RunRecord> {
        let tenant = record.key.tenant.clone();
        let keyed = Keyed::put_run(&tenant, &record, key)?;
        self.put_run_with(record, Some(keyed))
            .await
            .map_err(StateError::keyed)
    }

    pub(super) async fn get_run(&self, key: &RunKey) -> Result<Option<RunRecord>> {
        check_run_key(key)?;
        let p = keys::tenant(&key.tenant);
        let mut conn = self.conn().await?;
        let v: Option<Vec<u8>> = ::redis::cmd("HGET")
            .arg(keys::run(&p, &key.run_id))
            .arg("v")
            .query_on(&mut conn)
            .await?;
        v.map(|v| decode_run(&v, key)).transpose()
    }

    pub(super) async fn patch_run(&self, key: &RunKey, delta: StateDelta) -> Result<RunRecord> {
        check_run_key(key)?;
        self.patch(key, &delta, None, None).await.map(|(r, _)| r)
    }
    pub(super) async fn patch_run_idempotent(
        &self,
        key: &RunKey,
        delta: StateDelta,
        idempotency_key: &IdempotencyKey,
    ) -> Result<RunRecord> {
        let keyed = Keyed::patch_run(key, &delta, idempotency_key)?;
        check_run_key(key)?;
        self.patch(key, &delta, None, Some(keyed))
            .await
            .map(|(r, _)| r)
            .map_err(StateError::keyed)
    }
    pub(super) async fn list_runs(
        &self,
        q: &StateQuery,
        page: &PageRequest,
    ) -> Result<Page<RunRecord>> {
        check_id("tenant", &q.tenant)?;
        if let Some(s) = &q.session {
            check_id("session", s)?;
        }
        if let Some(a) = &q.agent {
            check_id("agent", a)?;
        }
        check_limit(page.limit)?;
        // A next page may name only the tenant: its cursor's filters (L7).
        let walk = agentstate_core::codec::cursor::runs_query(&self.secret().await?, q, page)?;
        let q = &*walk;
        let binding = agentstate_core::codec::cursor::runs_binding(q);
        let mut after = match &page.cursor {
            None => String::new(),
            Some(c) => {
                let pos = cursor_codec::decode(&self.secret().await?, Listing::Runs, &binding, c)?;
                let pos: [u8; 8] = pos
                    .try_into()
                    .map_err(|_| StateError::invalid("cursor: position outside this listing"))?;
                u64::from_be_bytes(pos).to_string()
            }
        };
        let p = keys::tenant(&q.tenant);
        // The label as its index suffix (runs_query checked it, R11).
        let label = q
            .label
            .as_ref()
            .map(|l| keys::label_suffix(&l.key, &agentstate_core::labels::canonical(&l.value)));
        // The narrowest index that answers the query (L5); a label is
        // usually narrower than a state.
        let index = match (&q.session, &label, q.state) {
            (Some(s), _, _) => keys::by_session(&p, s),
            (None, Some(l), _) => keys::by_label(&p, l),
            (None, None, Some(st)) => keys::by_state(&p, st),
            (None, None, None) => keys::runs(&p),
        };
        let mut conn = self.conn().await?;
        let mut items: Vec<(u64, RunRecord)> = Vec::with_capacity(page.limit + 1);
        loop {
            let reply: Reply = LIST_RUNS
                .key(&index)
                .arg(&p)
                .arg(&after)
                .arg((page.limit + 1 - items.len()).to_string())
                .arg(q.state.map(keys::state_tag).unwrap_or_default())
                .arg(q.session.clone().unwrap_or_default())
                .arg(q.agent.clone().unwrap_or_default())
                .arg(q.updated_before.map(|t| t.to_string()).unwrap_or_default())
                .arg(LIST_SCAN_CAP.to_string())
                .arg(label.as_deref().unwrap_or_default())
                .invoke(&mut conn)
                .await?;
            if reply.len() < 2 || !reply.len().is_multiple_of(2) {
                return Err(StateError::corrupt("redis: list_runs answer malformed"));
            }
            let exhausted = reply[1] == b"1";
            let last = text(&reply[0]);
            for pair in reply[2..].chunks_exact(2) {
                let seq = num(&pair[0], "run seq")?;
                let run = decode_any_run(&pair[1])?;
                if run.key.tenant != q.tenant {
                    return Err(StateError::corrupt(
                        "redis: a run index names another tenant's run",
                    ));
                }
                items.push((seq, run));
            }
            if items.len() > page.limit || exhausted || last.is_empty() {
                break;
            }
            after = last;
        }
        let more = items.len() > page.limit;
        items.truncate(page.limit);
        let cursor = match (more, items.last()) {
            (true, Some((seq, _))) => Some(cursor_codec::encode(
                &self.secret().await?,
                Listing::Runs,
                &binding,
                &seq.to_be_bytes(),
            )),
            _ => None,
        };
        Page::new(items.into_iter().map(|(_, r)| r).collect(), cursor)
    }

    pub(super) async fn put_session(&self, mut record: SessionRecord) -> Result<SessionRecord> {
        agentstate_core::rules::check_session(&record)?;
        self.opts
            .options
            .scrubber
            .scrub_session_in_place(&mut record);
        let max = self.max();
        let (h, crc) = session_head(&record);
        check_size("session record", h.len() + value::OVERHEAD_BYTES - 1, max)?;
        let p = keys::tenant(&record.key.tenant);
        let mut conn = self.conn().await?;
        self.writable(&mut conn).await?;
        self.register(&mut conn, &record.key.tenant).await?;
        let reply: Reply = PUT_SESSION
            .key(keys::session(&p, &record.key.session_id))
            .key(keys::sessions(&p))
            .arg(&record.key.session_id)
            .arg(record.version.to_string())
            .arg(&h)
            .arg(crc.to_string())
            .arg(self.now().to_string())
            .arg(max.to_string())
            .arg(&p)
            .invoke(&mut conn)
            .await?;
        let rest = outcome(
            reply,
            || RecordKey::Session(record.key.clone()),
            record.version,
        )
        .map_err(|e| with_limit(e, max))?;
        let v = rest
            .first()
            .ok_or_else(|| StateError::corrupt("redis: put_session answered no record"))?;
        decode_session(v, &record.key)
    }

    pub(super) async fn get_session(&self, key: &SessionKey) -> Result<Option<SessionRecord>> {
        check_session_key(key)?;
        let p = keys::tenant(&key.tenant);
        let mut conn = self.conn().await?;
        let v: Option<Vec<u8>> = ::redis::cmd("HGET")
            .arg(keys::session(&p, &key.session_id))
            .arg("v")
            .query_on(&mut conn)
            .await?;
        v.map(|v| decode_session(&v, key)).transpose()
    }

    /// R10 in one script (`lua/delete_run.lua`).
    pub(super) async fn delete_run(
        &self,
        key: &RunKey,
        expected_version: Option<u64>,
    ) -> Result<RunRecord> {
        check_run_key(key)?;
        let p = keys::tenant(&key.tenant);
        let mut conn = self.conn().await?;
        self.writable(&mut conn).await?;
        let reply: Reply = DELETE_RUN
            .key(keys::run(&p, &key.run_id))
            .key(keys::runs(&p))
            .arg(&p)
            .arg(&key.run_id)
            .arg(expected_version.map(|v| v.to_string()).unwrap_or_default())
            .invoke(&mut conn)
            .await?;
        if reply.first().map(Vec::as_slice) == Some(b"inuse") {
            return Err(StateError::InUse {
                record: RecordKey::Run(key.clone()),
                runs: vec![key.clone()],
            });
        }
        let rest = outcome(
            reply,
            || RecordKey::Run(key.clone()),
            expected_version.unwrap_or(0),
        )?;
        let v = rest
            .first()
            .ok_or_else(|| StateError::corrupt("redis: delete_run answered no record"))?;
        decode_run(v, key)
    }

    // Rules S2, S3: decided by the server's copy, lua/delete_session.lua.
    pub(super) async fn delete_session(
        &self,
        key: &SessionKey,
        cascade: bool,
    ) -> Result<Vec<RunKey>> {
        check_session_key(key)?;
        let p = keys::tenant(&key.tenant);
        let mut conn = self.conn().await?;
        self.writable(&mut conn).await?;
        let reply: Reply = DELETE_SESSION
            .key(keys::session(&p, &key.session_id))
            .key(keys::sessions(&p))
            .key(keys::by_session(&p, &key.session_id))
            .key(keys::runs(&p))
            .arg(&p)
            .arg(&key.session_id)
            .arg(if cascade { "1" } else { "0" })
            .invoke(&mut conn)
            .await?;
        let to_keys = |ids: &[Vec<u8>]| -> Result<Vec<RunKey>> {
            ids.iter()
                .map(|id| {
                    String::from_utf8(id.clone())
                        .map(|id| RunKey::new(key.tenant.clone(), id))
                        .map_err(|_| StateError::corrupt("redis: a run id is not UTF-8"))
                })
                .collect()
        };
        if reply.first().map(Vec::as_slice) == Some(b"inuse") {
            return Err(StateError::InUse {
                record: RecordKey::Session(key.clone()),
                runs: to_keys(&reply[1..])?,
            });
        }
        let rest = outcome(reply, || RecordKey::Session(key.clone()), 0)?;
        to_keys(&rest)
    }
}

/// A script's `toolarge` names the limit too.
pub(super) fn with_limit(e: StateError, max: usize) -> StateError {
    match e {
        StateError::Persistence {
            reason: agentstate_core::error::PersistenceReason::TooLarge,
            detail,
            ..
        } => StateError::too_large(format!("{detail} {max}")),
        e => e,
    }
}
