//! Trays, epochs and alarms on Redis (rules T, A): every operation that
//! names an instance is one call of `lua/trays.lua`, whose fence check runs
//! in the same step as its reads and writes (T6).

use serde::{Deserialize, Serialize};

use agentstate_core::codec::cursor::{self as cursor_codec, Listing};
use agentstate_core::codec::value;
use agentstate_core::error::{RecordKey, Result, StateError};
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::Millis;
use agentstate_core::rules::{
    check_batch, check_epoch, check_id, check_instance, check_limit, check_tray, check_tray_key,
};
use agentstate_core::tray::{Alarm, InstanceKey, MarkedTray, Tray, TrayFilter, TrayKey, TrayOp};

use super::runs::{Reply, head, num, outcome};
use agentstate_core::idempotency::{IdempotencyKey, Keyed};

use super::connect::QueryOn;
use super::scripts::{Idem, READ_PAGES, TRAYS};
use super::{RedisStore, keys};

#[derive(Serialize)]
struct TrayHeadRef<'a> {
    doc: &'a [u8],
    env: &'a str,
    hostname: &'a str,
}

/// A stored tray: the head the client encodes, then the marked flag the
/// script writes (so `release` can unmark without the client).
#[derive(Deserialize)]
struct StoredTray {
    doc: Vec<u8>,
    env: String,
    hostname: String,
    marked: bool,
}

pub(super) fn tray_head(t: &Tray) -> (Vec<u8>, u32) {
    head(&TrayHeadRef {
        doc: &t.doc,
        env: &t.env,
        hostname: &t.hostname,
    })
}

pub(super) fn decode_tray(v: &[u8]) -> Result<Tray> {
    let s: StoredTray = value::decode(v, "tray")?;
    Ok(Tray {
        marked: s.marked,
        doc: s.doc,
        env: s.env,
        hostname: s.hostname,
    })
}

/// One call of the tray script.
pub(super) struct TrayCall {
    inst: Vec<u8>,
    args: Vec<Vec<u8>>,
    idem: Option<Idem>,
}

impl TrayCall {
    pub(super) fn new(i: &InstanceKey, op: &str, epoch: u64) -> TrayCall {
        let inst = keys::inst(i);
        let args = vec![
            op.as_bytes().to_vec(),
            inst.clone(),
            epoch.to_string().into_bytes(),
            keys::tray_base(&inst),
            keys::marked_env_base(),
        ];
        TrayCall {
            inst,
            args,
            idem: None,
        }
    }
    pub(super) fn arg(mut self, a: impl Into<Vec<u8>>) -> TrayCall {
        self.args.push(a.into());
        self
    }
    /// A tray to write: member, head, head CRC, marked, env, hostname.
    pub(super) fn tray(self, member: Vec<u8>, t: &Tray) -> TrayCall {
        let (h, crc) = tray_head(t);
        self.arg(member)
            .arg(h)
            .arg(crc.to_string())
            .arg(if t.marked { "1" } else { "0" })
            .arg(t.env.as_bytes())
            .arg(t.hostname.as_bytes())
    }
    /// Runs the call under an idempotency key.
    pub(super) fn idem(mut self, idem: Option<Idem>) -> TrayCall {
        self.idem = idem;
        self
    }
    pub(super) async fn run(self, store: &RedisStore) -> Result<Reply> {
        let mut inv = TRAYS.prepare_invoke();
        inv.key(keys::instance(&self.inst))
            .key(keys::insts())
            .key(keys::trays_of(&self.inst))
            .key(keys::marked_of(&self.inst))
            .key(keys::marked())
            .key(keys::due())
            .key(keys::trays_feed());
        for a in &self.args {
            inv.arg(a);
        }
        inv.idem(self.idem.as_ref());
        let mut conn = store.conn().await?;
        store.writable(&mut conn).await?;
        inv.invoke(&mut conn).await
    }
}

impl RedisStore {
    // Rule T3: the fence once, then every op in one script (lua/trays.lua's batch).
    async fn apply_batch_with(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        keyed: Option<Keyed<'_>>,
    ) -> Result<()> {
        check_batch(instance, &ops, self.max())?;
        check_epoch(epoch)?;
        let mut call = TrayCall::new(instance, "batch", epoch).idem(self.idem(keyed));
        for op in &ops {
            call = match op {
                TrayOp::Put {
                    tray_ns,
                    tray_id,
                    tray,
                } => call
                    .arg("p")
                    .tray(keys::tray_member(tray_ns, tray_id), tray),
                TrayOp::Delete { tray_ns, tray_id } => {
                    call.arg("d").arg(keys::tray_member(tray_ns, tray_id))
                }
            };
        }
        outcome(
            call.run(self).await?,
            || RecordKey::Instance(instance.clone()),
            epoch,
        )
        .map(|_| ())
    }
}

impl RedisStore {
    pub(super) async fn read_tray(&self, key: &TrayKey, epoch: u64) -> Result<Option<Tray>> {
        check_tray_key(key)?;
        check_epoch(epoch)?;
        let reply = TrayCall::new(&key.instance(), "read", epoch)
            .arg(keys::tray_member_of(key))
            .run(self)
            .await?;
        if reply.first().map(Vec::as_slice) == Some(b"none") {
            return Ok(None);
        }
        let rest = outcome(reply, || RecordKey::Tray(key.clone()), epoch)?;
        let v = rest
            .first()
            .ok_or_else(|| StateError::corrupt("redis: read_tray answered no tray"))?;
        decode_tray(v).map(Some)
    }

    pub(super) async fn write_tray(&self, key: &TrayKey, epoch: u64, tray: Tray) -> Result<()> {
        check_tray_key(key)?;
        check_tray(&tray, self.max())?;
        check_epoch(epoch)?;
        let reply = TrayCall::new(&key.instance(), "write", epoch)
            .tray(keys::tray_member_of(key), &tray)
            .run(self)
            .await?;
        outcome(reply, || RecordKey::Tray(key.clone()), epoch).map(|_| ())
    }

    pub(super) async fn delete_tray(&self, key: &TrayKey, epoch: u64) -> Result<bool> {
        check_tray_key(key)?;
        check_epoch(epoch)?;
        let reply = TrayCall::new(&key.instance(), "delete", epoch)
            .arg(keys::tray_member_of(key))
            .run(self)
            .await?;
        let rest = outcome(reply, || RecordKey::Tray(key.clone()), epoch)?;
        Ok(rest.first().map(Vec::as_slice) == Some(b"1"))
    }

    pub(super) async fn apply_batch(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
    ) -> Result<()> {
        self.apply_batch_with(instance, epoch, ops, None).await
    }
    pub(super) async fn apply_batch_idempotent(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        key: &IdempotencyKey,
    ) -> Result<()> {
        let keyed = Keyed::apply_batch(instance, epoch, &ops, key)?;
        self.apply_batch_with(instance, epoch, ops, Some(keyed))
            .await
            .map_err(StateError::keyed)
    }

    pub(super) async fn release(&self, instance: &InstanceKey, epoch: u64) -> Result<()> {
        check_instance(instance)?;
        check_epoch(epoch)?;
        let reply = TrayCall::new(instance, "release", epoch).run(self).await?;
        outcome(reply, || RecordKey::Instance(instance.clone()), epoch).map(|_| ())
    }

    pub(super) async fn list_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        page: &PageRequest,
    ) -> Result<Page<(TrayKey, Tray)>> {
        check_instance(instance)?;
        check_epoch(epoch)?;
        check_limit(page.limit)?;
        let inst = keys::inst(instance);
        // E6: a cursor of another listing fails before the fence can
        // advance the epoch.
        let after = match &page.cursor {
            Some(c) => cursor_codec::decode(&self.secret().await?, Listing::Trays, &inst, c)?,
            None => Vec::new(),
        };
        if !after.is_empty() {
            keys::read_tray_member(&after)
                .map_err(|_| StateError::invalid("cursor: position outside this listing"))?;
        }
        let reply = TrayCall::new(instance, "list", epoch)
            .arg(after)
            .arg((page.limit + 1).to_string())
            .run(self)
            .await?;
        let rest = outcome(reply, || RecordKey::Instance(instance.clone()), epoch)?;
        if !rest.len().is_multiple_of(2) {
            return Err(StateError::corrupt("redis: list_trays answer malformed"));
        }
        let mut items = Vec::with_capacity(rest.len() / 2);
        for pair in rest.chunks_exact(2) {
            let (tray_ns, tray_id) = keys::read_tray_member(&pair[0])?;
            items.push((
                pair[0].clone(),
                (instance.tray(tray_ns, tray_id), decode_tray(&pair[1])?),
            ));
        }
        let more = items.len() > page.limit;
        items.truncate(page.limit);
        let cursor = match (more, items.last()) {
            (true, Some((m, _))) => Some(cursor_codec::encode(
                &self.secret().await?,
                Listing::Trays,
                &inst,
                m,
            )),
            _ => None,
        };
        Page::new(items.into_iter().map(|(_, t)| t).collect(), cursor)
    }

    /// T7: the fence and every tray of the instance that passes `filter`,
    /// in one call of the script (one step on the server, so one
    /// snapshot), the filters applied there.
    pub(super) async fn instance_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        filter: &TrayFilter,
    ) -> Result<Vec<(TrayKey, Tray)>> {
        check_instance(instance)?;
        check_epoch(epoch)?;
        filter.check()?;
        // The members of one tray namespace are one range of the
        // instance's index (members are self-delimiting and order as
        // their bytes do).
        let (lo, hi) = match &filter.tray_ns {
            Some(ns) => {
                let prefix = keys::tray_ns_prefix(ns);
                let mut lo = b"[".to_vec();
                lo.extend_from_slice(&prefix);
                let mut hi = b"(".to_vec();
                hi.extend(agentstate_core::codec::key::prefix_end(&prefix));
                (lo, hi)
            }
            None => (b"-".to_vec(), b"+".to_vec()),
        };
        let marked = match filter.marked {
            None => "",
            Some(true) => "1",
            Some(false) => "0",
        };
        let reply = TrayCall::new(instance, "trays", epoch)
            .arg(lo)
            .arg(hi)
            .arg(marked)
            .run(self)
            .await?;
        let rest = outcome(reply, || RecordKey::Instance(instance.clone()), epoch)?;
        if !rest.len().is_multiple_of(2) {
            return Err(StateError::corrupt(
                "redis: instance_trays answer malformed",
            ));
        }
        let mut out = Vec::with_capacity(rest.len() / 2);
        for pair in rest.chunks_exact(2) {
            let (tray_ns, tray_id) = keys::read_tray_member(&pair[0])?;
            let (key, tray) = (instance.tray(tray_ns, tray_id), decode_tray(&pair[1])?);
            // The script picked them by its indexes; the decoded trays
            // must agree.
            if !filter.matches(&key, &tray) {
                return Err(StateError::corrupt(
                    "redis: instance_trays answered a tray its filter excludes",
                ));
            }
            out.push((key, tray));
        }
        Ok(out)
    }

    pub(super) async fn marked_trays(
        &self,
        env: Option<&str>,
        page: &PageRequest,
    ) -> Result<Page<MarkedTray>> {
        if let Some(e) = env {
            check_id("env", e)?;
        }
        check_limit(page.limit)?;
        let (index, binding) = match env {
            Some(e) => (keys::marked_env(e), keys::marked_env(e)),
            None => (keys::marked(), keys::marked()),
        };
        let after = match &page.cursor {
            Some(c) => {
                let pos =
                    cursor_codec::decode(&self.secret().await?, Listing::Marked, &binding, c)?;
                keys::read_inst(&pos)
                    .and_then(|(_, rest)| keys::read_tray_member(rest))
                    .map_err(|_| StateError::invalid("cursor: position outside this listing"))?;
                pos
            }
            None => Vec::new(),
        };
        let mut conn = self.conn().await?;
        let reply: Reply = READ_PAGES
            .key(&index)
            .arg("marked")
            .arg(keys::all_tray_base())
            .arg(after)
            .arg((page.limit + 1).to_string())
            .invoke(&mut conn)
            .await?;
        if !reply.len().is_multiple_of(3) {
            return Err(StateError::corrupt("redis: marked_trays answer malformed"));
        }
        let mut items = Vec::with_capacity(reply.len() / 3);
        for t in reply.chunks_exact(3) {
            let (i, rest) = keys::read_inst(&t[0])?;
            let (tray_ns, tray_id) = keys::read_tray_member(rest)?;
            let utf8 = |b: &[u8]| {
                String::from_utf8(b.to_vec())
                    .map_err(|_| StateError::corrupt("redis: a tray's env is not UTF-8"))
            };
            items.push((
                t[0].clone(),
                MarkedTray::new(i.tray(tray_ns, tray_id), utf8(&t[1])?, utf8(&t[2])?),
            ));
        }
        let more = items.len() > page.limit;
        items.truncate(page.limit);
        let cursor = match (more, items.last()) {
            (true, Some((m, _))) => Some(cursor_codec::encode(
                &self.secret().await?,
                Listing::Marked,
                &binding,
                m,
            )),
            _ => None,
        };
        Page::new(items.into_iter().map(|(_, t)| t).collect(), cursor)
    }

    pub(super) async fn epoch(&self, instance: &InstanceKey) -> Result<u64> {
        check_instance(instance)?;
        let mut conn = self.conn().await?;
        let e: Option<Vec<u8>> = ::redis::cmd("HGET")
            .arg(keys::instance(&keys::inst(instance)))
            .arg("ep")
            .query_on(&mut conn)
            .await?;
        e.map(|e| num(&e, "epoch"))
            .transpose()
            .map(|e| e.unwrap_or(0))
    }

    pub(super) async fn set_alarm(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        due_at: Millis,
    ) -> Result<()> {
        check_instance(instance)?;
        check_epoch(epoch)?;
        let reply = TrayCall::new(instance, "alarm", epoch)
            .arg(keys::alarm_member(due_at, instance))
            .arg(due_at.to_string())
            .run(self)
            .await?;
        outcome(reply, || RecordKey::Instance(instance.clone()), epoch).map(|_| ())
    }

    #[allow(
        clippy::expect_used,
        reason = "a slice cut to a fixed length by its range converts to an array of that length"
    )]
    pub(super) async fn due_alarms(&self, now: Millis, page: &PageRequest) -> Result<Page<Alarm>> {
        check_limit(page.limit)?;
        let mut from = b"-".to_vec();
        if let Some(c) = &page.cursor {
            let pos = cursor_codec::decode(&self.secret().await?, Listing::Alarms, b"alarms", c)?;
            if pos.len() < 8 || keys::read_inst(&pos[8..]).is_err() {
                return Err(StateError::invalid("cursor: position outside this listing"));
            }
            from = b"(".to_vec();
            from.extend(pos);
        }
        let to = match now.checked_add(1) {
            Some(n) => {
                let mut t = b"(".to_vec();
                t.extend(n.to_be_bytes());
                t
            }
            None => b"+".to_vec(),
        };
        let mut conn = self.conn().await?;
        let members: Vec<Vec<u8>> = ::redis::cmd("ZRANGEBYLEX")
            .arg(keys::due())
            .arg(from)
            .arg(to)
            .arg("LIMIT")
            .arg(0)
            .arg(page.limit + 1)
            .query_on(&mut conn)
            .await?;
        let mut items = Vec::with_capacity(members.len());
        for m in members {
            if m.len() < 8 {
                return Err(StateError::corrupt("redis: alarm index member truncated"));
            }
            let due_at = u64::from_be_bytes(m[..8].try_into().expect("8 bytes"));
            let (instance, rest) = keys::read_inst(&m[8..])?;
            if !rest.is_empty() {
                return Err(StateError::corrupt(
                    "redis: trailing bytes in an alarm member",
                ));
            }
            items.push((m, Alarm::new(instance, due_at)));
        }
        let more = items.len() > page.limit;
        items.truncate(page.limit);
        let cursor = match (more, items.last()) {
            (true, Some((m, _))) => Some(cursor_codec::encode(
                &self.secret().await?,
                Listing::Alarms,
                b"alarms",
                m,
            )),
            _ => None,
        };
        Page::new(items.into_iter().map(|(_, a)| a).collect(), cursor)
    }

    pub(super) async fn ack_alarm(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        due_at: Millis,
    ) -> Result<bool> {
        check_instance(instance)?;
        check_epoch(epoch)?;
        let reply = TrayCall::new(instance, "ack", epoch)
            .arg(due_at.to_string())
            .run(self)
            .await?;
        let rest = outcome(reply, || RecordKey::Instance(instance.clone()), epoch)?;
        Ok(rest.first().map(Vec::as_slice) == Some(b"1"))
    }
}
