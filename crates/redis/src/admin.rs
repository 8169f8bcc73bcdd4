//! The operator functions on Redis (`StoreAdmin`): sessions listing,
//! counts, checks, retention, export and import. The walks read the tenant
//! registry and the instance index; they are admin work, O(records).

use agentstate_core::admin::{StoreAdmin, StoreStats, TenantStats, VerifyReport};
use agentstate_core::codec::cursor::{self as cursor_codec, Listing};
use agentstate_core::codec::key::{KeyBuf, KeyReader};
use agentstate_core::entry::Entry;
use agentstate_core::error::{Result, StateError};
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{Millis, RunKey, RunState, SessionKey, SessionRecord};
use agentstate_core::rules::{check_id, check_limit, checked_entry};

use super::budgets::{BUDGET_FIELDS, budget_row, hold_value, parse_hold};
use super::connect::QueryOn;
use super::runs::{
    Reply, decode_run, decode_session, num, outcome, run_head, run_tail, seal, session_head,
    session_tail, text,
};
use super::scripts::{BUDGETS, FEED, IMPORT, PRUNE, PURGE, READ_PAGES};
use super::trays::{TrayCall, decode_tray};
use super::{Conn, RedisStore, keys};

/// Largest `seq` an import accepts: sorted-set scores are doubles, exact
/// to 2^53.
const SEQ_MAX: u64 = 1 << 53;
/// Index entries read per command of a walk.
const CHUNK: usize = 1000;

fn cmd(name: &str) -> ::redis::Cmd {
    ::redis::cmd(name)
}

impl RedisStore {
    async fn tenants(&self, conn: &mut Conn) -> Result<Vec<String>> {
        let t: Vec<Vec<u8>> = cmd("ZRANGE")
            .arg(keys::TENANTS)
            .arg(0)
            .arg(-1)
            .query_on(conn)
            .await?;
        t.into_iter()
            .map(|t| {
                String::from_utf8(t).map_err(|_| StateError::corrupt("redis: tenant not UTF-8"))
            })
            .collect()
    }

    async fn instances(&self, conn: &mut Conn) -> Result<Vec<Vec<u8>>> {
        cmd("ZRANGE")
            .arg(keys::insts())
            .arg(0)
            .arg(-1)
            .query_on(conn)
            .await
    }

    /// Members of a lexicographic sorted set after `after`, at most `n`.
    pub(super) async fn lex_after(
        &self,
        conn: &mut Conn,
        key: &[u8],
        after: Option<&[u8]>,
        n: usize,
    ) -> Result<Vec<Vec<u8>>> {
        let from = match after {
            Some(a) => {
                let mut f = b"(".to_vec();
                f.extend_from_slice(a);
                f
            }
            None => b"-".to_vec(),
        };
        cmd("ZRANGEBYLEX")
            .arg(key)
            .arg(from)
            .arg("+")
            .arg("LIMIT")
            .arg(0)
            .arg(n)
            .query_on(conn)
            .await
    }

    /// (member, seq) of a seq-scored sorted set after `after`, at most `n`.
    async fn seq_after(
        &self,
        conn: &mut Conn,
        key: &[u8],
        after: Option<u64>,
        n: usize,
    ) -> Result<Vec<(Vec<u8>, u64)>> {
        let from = after.map_or("-inf".to_string(), |s| format!("({s}"));
        let r: Vec<(Vec<u8>, Vec<u8>)> = cmd("ZRANGEBYSCORE")
            .arg(key)
            .arg(from)
            .arg("+inf")
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(n)
            .query_on(conn)
            .await?;
        r.into_iter()
            .map(|(m, s)| Ok((m, num(&s, "seq score")?)))
            .collect()
    }

    async fn hget(&self, conn: &mut Conn, key: &[u8], field: &str) -> Result<Option<Vec<u8>>> {
        cmd("HGET").arg(key).arg(field).query_on(conn).await
    }

    /// True when a run the session index `index` names is unfinished
    /// (in one of the unfinished states' indexes): its session must be
    /// there (S2).
    async fn any_unfinished(&self, conn: &mut Conn, p: &[u8], index: &[u8]) -> Result<bool> {
        let ids: Vec<Vec<u8>> = ::redis::cmd("ZRANGE")
            .arg(index)
            .arg(0)
            .arg(-1)
            .query_on(conn)
            .await?;
        for id in &ids {
            for st in RunState::ALL.into_iter().filter(|s| !s.is_finished()) {
                let score: Option<f64> = ::redis::cmd("ZSCORE")
                    .arg(keys::by_state(p, st))
                    .arg(id)
                    .query_on(conn)
                    .await?;
                if score.is_some() {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    async fn zcard(&self, conn: &mut Conn, key: &[u8]) -> Result<u64> {
        cmd("ZCARD").arg(key).query_on(conn).await
    }
}

/// An export position: phase, group (tenant or instance), inner position.
fn export_pos(phase: u8, group: &[u8], inner: &[u8]) -> Vec<u8> {
    let mut p = vec![phase];
    p.extend((group.len() as u32).to_be_bytes());
    p.extend_from_slice(group);
    p.extend_from_slice(inner);
    p
}

fn read_export_pos(p: &[u8]) -> Option<(u8, Vec<u8>, Vec<u8>)> {
    let (&phase, rest) = p.split_first()?;
    let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let group = rest.get(4..4 + len)?.to_vec();
    let inner = rest.get(4 + len..)?.to_vec();
    (1..=7).contains(&phase).then_some((phase, group, inner))
}

/// In place of a hold id, in an export position: the run was read whole
/// (no UTF-8 hold id has a 0xFF byte).
const RUN_DONE: &[u8] = &[0xFF];

/// A hold's export position within its tenant: the run id's length, the
/// run id, the hold id.
fn hold_pos(run_id: &str, hold_id: &str) -> Vec<u8> {
    let mut p = (run_id.len() as u32).to_be_bytes().to_vec();
    p.extend_from_slice(run_id.as_bytes());
    p.extend_from_slice(hold_id.as_bytes());
    p
}

fn read_hold_pos(p: &[u8]) -> Result<(Vec<u8>, Vec<u8>)> {
    let bad = || StateError::invalid("cursor: position outside this listing");
    let len = u32::from_be_bytes(p.get(..4).ok_or_else(bad)?.try_into().map_err(|_| bad())?);
    let run = p.get(4..4 + len as usize).ok_or_else(bad)?;
    Ok((run.to_vec(), p[4 + len as usize..].to_vec()))
}

impl RedisStore {
    /// Export phase 2: a tenant's holds in (run id, hold id) order after
    /// `inner`, at most about `n` (a run's holds come whole); how many
    /// runs were read, so `< n` means the tenant is done.
    async fn export_holds(
        &self,
        conn: &mut Conn,
        t: &str,
        inner: &mut Option<Vec<u8>>,
        n: usize,
        out: &mut Vec<(Vec<u8>, Entry)>,
    ) -> Result<usize> {
        let p = keys::tenant(t);
        let (from, skip) = match inner.as_deref() {
            None => (b"-".to_vec(), None),
            Some(pos) => {
                let (run, hold) = read_hold_pos(pos)?;
                // A run read whole resumes after it; else within it.
                let whole = hold == RUN_DONE;
                let mut f = if whole { b"(".to_vec() } else { b"[".to_vec() };
                f.extend_from_slice(&run);
                (f, (!whole).then_some((run, hold)))
            }
        };
        let runs: Vec<Vec<u8>> = cmd("ZRANGEBYLEX")
            .arg(keys::holds_index(&p))
            .arg(from)
            .arg("+")
            .arg("LIMIT")
            .arg(0)
            .arg(n)
            .query_on(conn)
            .await?;
        let got = runs.len();
        for run in runs {
            let run_id = text(&run);
            let all: Vec<(Vec<u8>, Vec<u8>)> = cmd("HGETALL")
                .arg(keys::holds(&p, &run_id))
                .query_on(conn)
                .await?;
            let mut holds = all
                .into_iter()
                .map(|(id, v)| parse_hold(&text(&id), &v))
                .collect::<Result<Vec<_>>>()?;
            holds.sort_by(|a, b| a.id.cmp(&b.id));
            for hold in holds {
                if let Some((sr, sh)) = &skip
                    && sr == &run
                    && hold.id.as_bytes() <= sh.as_slice()
                {
                    continue;
                }
                let pos = hold_pos(&run_id, &hold.id);
                *inner = Some(pos.clone());
                out.push((
                    export_pos(2, t.as_bytes(), &pos),
                    Entry::Hold {
                        run: RunKey::new(t, run_id.clone()),
                        hold,
                    },
                ));
            }
            let mut done = hold_pos(&run_id, "");
            done.extend_from_slice(RUN_DONE);
            *inner = Some(done);
        }
        Ok(got)
    }

    /// Export phase 4: a tenant's budgets in name order after `inner`.
    async fn export_budgets(
        &self,
        conn: &mut Conn,
        t: &str,
        inner: &mut Option<Vec<u8>>,
        n: usize,
        out: &mut Vec<(Vec<u8>, Entry)>,
    ) -> Result<usize> {
        let p = keys::tenant(t);
        let names = self
            .lex_after(conn, &keys::budgets(&p), inner.as_deref(), n)
            .await?;
        let got = names.len();
        for name in names {
            *inner = Some(name.clone());
            let key = agentstate_core::budget::BudgetKey::new(t, text(&name));
            let fields: Vec<Option<Vec<u8>>> = cmd("HMGET")
                .arg(keys::budget(&p, &key.name))
                .arg(&BUDGET_FIELDS[..])
                .query_on(conn)
                .await?;
            if let Some((budget, spent)) = budget_row(&key, &fields)? {
                out.push((
                    export_pos(4, t.as_bytes(), &name),
                    Entry::Budget { budget, spent },
                ));
            }
        }
        Ok(got)
    }
}

impl StoreAdmin for RedisStore {
    /// Its calls are awaited natively by `AsyncStore`, over its async core.
    fn async_core(
        self: std::sync::Arc<Self>,
    ) -> Option<std::sync::Arc<dyn agentstate_core::native::DynCore>> {
        Some(self)
    }

    fn list_sessions(&self, tenant: &str, page: &PageRequest) -> Result<Page<SessionRecord>> {
        self.bridge
            .block_on(agentstate_core::native::AsyncCore::list_sessions(
                self, tenant, page,
            ))
    }

    fn is_empty(&self) -> Result<bool> {
        self.bridge.block_on(self.is_empty_impl())
    }

    fn stats(&self) -> Result<StoreStats> {
        self.bridge.block_on(agentstate_core::observe::call(
            "redis",
            "stats",
            None,
            self.stats_impl(),
        ))
    }

    fn verify(&self) -> Result<VerifyReport> {
        self.bridge.block_on(agentstate_core::observe::call(
            "redis",
            "verify",
            None,
            self.verify_impl(),
        ))
    }

    fn prune(&self, tenant: &str, finished_before: Millis) -> Result<u64> {
        self.bridge.block_on(agentstate_core::observe::call(
            "redis",
            "prune",
            Some(tenant),
            self.prune_impl(tenant, finished_before),
        ))
    }

    fn purge_tenant(&self, tenant: &str) -> Result<u64> {
        self.bridge.block_on(agentstate_core::observe::call(
            "redis",
            "purge_tenant",
            Some(tenant),
            self.purge_tenant_impl(tenant),
        ))
    }

    fn export_page(&self, page: &PageRequest) -> Result<Page<Entry>> {
        self.bridge.block_on(agentstate_core::observe::call(
            "redis",
            "export_page",
            None,
            self.export_page_impl(page),
        ))
    }

    fn import(&self, entries: &mut dyn Iterator<Item = Result<Entry>>) -> Result<u64> {
        if !self.is_empty()? {
            return Err(StateError::invalid(
                "import: the store is not empty; import into a new store",
            ));
        }
        // The whole input is read and checked before the first write, so a
        // bad line, a bad entry or a duplicate writes nothing. The writes
        // are one script per entry: a server failure in the middle can
        // leave part of an import (the caller sees the store non-empty).
        let max = self.max();
        let all = entries
            .map(|e| checked_entry(e?, &self.opts.options.scrubber, max))
            .collect::<Result<Vec<Entry>>>()?;
        agentstate_core::rules::check_import_unique(&all)?;
        let n = all.len() as u64;
        self.bridge.block_on(agentstate_core::observe::call(
            "redis",
            "import",
            None,
            async {
                for e in all {
                    self.import_one(e).await?;
                }
                Ok(n)
            },
        ))
    }
}

impl RedisStore {
    pub(super) async fn list_sessions(
        &self,
        tenant: &str,
        page: &PageRequest,
    ) -> Result<Page<SessionRecord>> {
        check_id("tenant", tenant)?;
        check_limit(page.limit)?;
        let binding = KeyBuf::table(Listing::Sessions as u8).str(tenant).done();
        let after = match &page.cursor {
            Some(c) => cursor_codec::decode(&self.secret().await?, Listing::Sessions, &binding, c)?,
            None => Vec::new(),
        };
        let p = keys::tenant(tenant);
        let mut conn = self.conn().await?;
        let reply: Reply = READ_PAGES
            .key(keys::sessions(&p))
            .arg("sessions")
            .arg(keys::session_base(&p))
            .arg(after)
            .arg((page.limit + 1).to_string())
            .invoke(&mut conn)
            .await?;
        let mut items = Vec::new();
        for pair in reply.chunks_exact(2) {
            let id = String::from_utf8(pair[0].clone())
                .map_err(|_| StateError::corrupt("redis: session id not UTF-8"))?;
            let s = decode_session(&pair[1], &SessionKey::new(tenant, id))?;
            items.push((pair[0].clone(), s));
        }
        let more = items.len() > page.limit;
        items.truncate(page.limit);
        let cursor = match (more, items.last()) {
            (true, Some((m, _))) => Some(cursor_codec::encode(
                &self.secret().await?,
                Listing::Sessions,
                &binding,
                m,
            )),
            _ => None,
        };
        Page::new(items.into_iter().map(|(_, s)| s).collect(), cursor)
    }

    async fn is_empty_impl(&self) -> Result<bool> {
        Ok(self
            .export_page_impl(&PageRequest::new(1))
            .await?
            .items()
            .is_empty())
    }

    async fn stats_impl(&self) -> Result<StoreStats> {
        let mut conn = self.conn().await?;
        let mut s = StoreStats::default();
        let replicas = match self.opts.wait_replicas {
            Some((n, t)) => format!(
                "; each write waits for {n} replica(s) (WAIT, up to {t:?}), so an Ok survives \
                 losing the master"
            ),
            None => "; replication (if any) is asynchronous: a failover may lose the last \
                     acknowledged writes (RedisOptions::wait_replicas)"
                .to_string(),
        };
        s.backend = format!("redis {}: {}{replicas}", self.server, self.durability());
        for t in self.tenants(&mut conn).await? {
            let p = keys::tenant(&t);
            let mut ts = TenantStats::default();
            for st in RunState::ALL {
                let n = self.zcard(&mut conn, &keys::by_state(&p, st)).await?;
                if n > 0 {
                    ts.runs_by_state.insert(st, n);
                }
            }
            ts.sessions = self.zcard(&mut conn, &keys::sessions(&p)).await?;
            self.budget_stats(&mut conn, &t, &mut ts).await?;
            if ts.sessions > 0 || ts.budgets > 0 || !ts.runs_by_state.is_empty() {
                s.tenants.insert(t, ts);
            }
        }
        for i in self.instances(&mut conn).await? {
            s.trays += self.zcard(&mut conn, &keys::trays_of(&i)).await?;
        }
        s.marked_trays = self.zcard(&mut conn, &keys::marked()).await?;
        s.alarms = self.zcard(&mut conn, &keys::due()).await?;
        Ok(s)
    }

    async fn prune_impl(&self, tenant: &str, finished_before: Millis) -> Result<u64> {
        check_id("tenant", tenant)?;
        let p = keys::tenant(tenant);
        let mut conn = self.conn().await?;
        self.writable(&mut conn).await?;
        let mut deleted = 0u64;
        for st in RunState::ALL.into_iter().filter(|s| s.is_finished()) {
            let index = keys::by_state(&p, st);
            let mut after = None;
            loop {
                let chunk = self.seq_after(&mut conn, &index, after, 256).await?;
                let Some((_, last)) = chunk.last() else { break };
                after = Some(*last);
                let mut inv = PRUNE.prepare_invoke();
                inv.key(keys::runs(&p))
                    .arg(&p)
                    .arg(finished_before.to_string());
                for (id, _) in &chunk {
                    inv.arg(id);
                }
                let n: String = inv.invoke(&mut conn).await?;
                deleted += num(n.as_bytes(), "pruned count")?;
                if chunk.len() < 256 {
                    break;
                }
            }
        }
        Ok(deleted)
    }

    /// P1: `SCAN` for the tenant's keys (one prefix, one hash tag), each
    /// batch deleted by one script; then the feed's horizon moved past
    /// every position (its counter and horizon are the keys the purge
    /// keeps), and the tenant's entry in the tenants index last. Running
    /// it again finishes a purge cut short.
    async fn purge_tenant_impl(&self, tenant: &str) -> Result<u64> {
        check_id("tenant", tenant)?;
        let p = keys::tenant(tenant);
        let pattern = scan_pattern(&p);
        let fd = keys::feed(&p);
        let kept = [keys::feed_counter(&fd), keys::feed_horizon(&fd)];
        let mut conn = self.conn().await?;
        self.writable(&mut conn).await?;
        let mut counted = 0u64;
        // Until a whole SCAN finds nothing: keys written while it ran are
        // found by the next pass.
        loop {
            let mut cursor = 0u64;
            let mut found = 0usize;
            loop {
                let (next, batch): (u64, Vec<Vec<u8>>) = cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(1000)
                    .query_on(&mut conn)
                    .await?;
                let batch: Vec<Vec<u8>> = batch.into_iter().filter(|k| !kept.contains(k)).collect();
                if !batch.is_empty() {
                    found += batch.len();
                    let mut inv = PURGE.prepare_invoke();
                    for k in &batch {
                        inv.key(k);
                    }
                    inv.arg(&p);
                    let n: String = inv.invoke(&mut conn).await?;
                    counted += num(n.as_bytes(), "purged count")?;
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
            if found == 0 {
                break;
            }
        }
        let _: Vec<Vec<u8>> = FEED.key(&fd).arg("purged").invoke(&mut conn).await?;
        let _: i64 = cmd("ZREM")
            .arg(keys::TENANTS)
            .arg(tenant)
            .query_on(&mut conn)
            .await?;
        Ok(counted)
    }

    async fn export_page_impl(&self, page: &PageRequest) -> Result<Page<Entry>> {
        check_limit(page.limit)?;
        let (start_phase, start_group, start_inner) = match &page.cursor {
            None => (1, Vec::new(), None),
            Some(c) => {
                let pos =
                    cursor_codec::decode(&self.secret().await?, Listing::Export, b"export", c)?;
                let (ph, g, i) = read_export_pos(&pos)
                    .ok_or_else(|| StateError::invalid("cursor: position outside this listing"))?;
                (ph, g, Some(i))
            }
        };
        let want = page.limit + 1;
        let mut conn = self.conn().await?;
        let mut out: Vec<(Vec<u8>, Entry)> = Vec::with_capacity(want);
        let tenants = self.tenants(&mut conn).await?;
        let insts = self.instances(&mut conn).await?;
        'phases: for phase in start_phase..=7u8 {
            let first = phase == start_phase;
            match phase {
                1..=4 => {
                    for t in &tenants {
                        if first && t.as_bytes() < start_group.as_slice() {
                            continue;
                        }
                        let mut inner = if first && t.as_bytes() == start_group.as_slice() {
                            start_inner.clone()
                        } else {
                            None
                        };
                        let p = keys::tenant(t);
                        loop {
                            let n = (want - out.len()).min(CHUNK);
                            let got = if phase == 1 {
                                let after = match &inner {
                                    Some(i) => Some(u64::from_be_bytes(
                                        i.as_slice().try_into().map_err(|_| {
                                            StateError::invalid(
                                                "cursor: position outside this listing",
                                            )
                                        })?,
                                    )),
                                    None => None,
                                };
                                let ids =
                                    self.seq_after(&mut conn, &keys::runs(&p), after, n).await?;
                                let got = ids.len();
                                for (id, seq) in ids {
                                    let run_id = text(&id);
                                    let pos = seq.to_be_bytes().to_vec();
                                    inner = Some(pos.clone());
                                    let v =
                                        self.hget(&mut conn, &keys::run(&p, &run_id), "v").await?;
                                    if let Some(v) = v {
                                        let r = decode_run(&v, &RunKey::new(t.clone(), run_id))?;
                                        out.push((
                                            export_pos(1, t.as_bytes(), &pos),
                                            Entry::Run(r),
                                        ));
                                    }
                                }
                                got
                            } else if phase == 2 {
                                self.export_holds(&mut conn, t, &mut inner, n, &mut out)
                                    .await?
                            } else if phase == 4 {
                                self.export_budgets(&mut conn, t, &mut inner, n, &mut out)
                                    .await?
                            } else {
                                let ids = self
                                    .lex_after(&mut conn, &keys::sessions(&p), inner.as_deref(), n)
                                    .await?;
                                let got = ids.len();
                                for id in ids {
                                    inner = Some(id.clone());
                                    let sid = text(&id);
                                    let v =
                                        self.hget(&mut conn, &keys::session(&p, &sid), "v").await?;
                                    if let Some(v) = v {
                                        let s =
                                            decode_session(&v, &SessionKey::new(t.clone(), sid))?;
                                        out.push((
                                            export_pos(3, t.as_bytes(), &id),
                                            Entry::Session(s),
                                        ));
                                    }
                                }
                                got
                            };
                            if out.len() >= want {
                                break 'phases;
                            }
                            if got < n {
                                break;
                            }
                        }
                    }
                }
                5 | 7 => {
                    for i in &insts {
                        if first && start_inner.as_deref().is_some_and(|s| i.as_slice() <= s) {
                            continue;
                        }
                        let (instance, _) = keys::read_inst(i)?;
                        let field = if phase == 5 { "ep" } else { "al" };
                        if let Some(v) = self.hget(&mut conn, &keys::instance(i), field).await? {
                            let n = num(&v, field)?;
                            let e = if phase == 5 {
                                Entry::Epoch { instance, epoch: n }
                            } else {
                                Entry::Alarm {
                                    instance,
                                    due_at: n,
                                }
                            };
                            out.push((export_pos(phase, b"", i), e));
                            if out.len() >= want {
                                break 'phases;
                            }
                        }
                    }
                }
                _ => {
                    for i in &insts {
                        if first && i.as_slice() < start_group.as_slice() {
                            continue;
                        }
                        let (instance, _) = keys::read_inst(i)?;
                        let mut inner = if first && i == &start_group {
                            start_inner.clone()
                        } else {
                            None
                        };
                        loop {
                            let n = (want - out.len()).min(CHUNK);
                            let members = self
                                .lex_after(&mut conn, &keys::trays_of(i), inner.as_deref(), n)
                                .await?;
                            let got = members.len();
                            for m in members {
                                inner = Some(m.clone());
                                let mut tk = keys::tray_base(i);
                                tk.extend_from_slice(&m);
                                if let Some(v) = self.hget(&mut conn, &tk, "v").await? {
                                    let (tray_ns, tray_id) = keys::read_tray_member(&m)?;
                                    out.push((
                                        export_pos(6, i, &m),
                                        Entry::Tray {
                                            key: instance.tray(tray_ns, tray_id),
                                            tray: decode_tray(&v)?,
                                        },
                                    ));
                                }
                            }
                            if out.len() >= want {
                                break 'phases;
                            }
                            if got < n {
                                break;
                            }
                        }
                    }
                }
            }
        }
        let more = out.len() > page.limit;
        out.truncate(page.limit);
        let cursor = match (more, out.last()) {
            (true, Some((pos, _))) => Some(cursor_codec::encode(
                &self.secret().await?,
                Listing::Export,
                b"export",
                pos,
            )),
            _ => None,
        };
        Page::new(out.into_iter().map(|(_, e)| e).collect(), cursor)
    }
}

impl RedisStore {
    async fn import_one(&self, e: Entry) -> Result<()> {
        // The record each entry's answer names, when it already exists.
        let record = e.record_key();
        match e {
            Entry::Run(r) => {
                if r.seq > SEQ_MAX {
                    return Err(StateError::invalid(format!(
                        "run {}: seq {} is past 2^53, the largest a Redis sorted set orders exactly",
                        r.key.run_id, r.seq
                    )));
                }
                let (h, crc) = run_head(&r);
                let v = seal(&h, &run_tail(&r));
                agentstate_core::rules::check_size("run record", v.len(), self.max())?;
                let p = keys::tenant(&r.key.tenant);
                let session = r.session_id.clone().unwrap_or_default();
                let mut conn = self.conn().await?;
                self.writable(&mut conn).await?;
                self.register(&mut conn, &r.key.tenant).await?;
                let reply: Reply = IMPORT
                    .key(keys::run(&p, &r.key.run_id))
                    .key(keys::seq(&p))
                    .key(keys::runs(&p))
                    .key(keys::by_session(&p, &session))
                    .arg("run")
                    .arg(&p)
                    .arg(&r.key.run_id)
                    .arg(v)
                    .arg(h.len().to_string())
                    .arg(crc.to_string())
                    .arg(r.version.to_string())
                    .arg(r.seq.to_string())
                    .arg(keys::state_tag(r.state))
                    .arg(&session)
                    .arg(&r.agent_name)
                    .arg(r.created_at.to_string())
                    .arg(r.updated_at.to_string())
                    .arg(r.messages_read.to_string())
                    .arg(r.usage.input_tokens.to_string())
                    .arg(r.usage.output_tokens.to_string())
                    .arg(r.cost_micros.to_string())
                    .arg(r.iterations.to_string())
                    .arg(super::runs::caps_arg(&r.caps))
                    .arg(r.budget.clone().unwrap_or_default())
                    .arg(keys::label_field(&r.labels))
                    .invoke(&mut conn)
                    .await?;
                if reply.first().map(Vec::as_slice) == Some(b"seqused") {
                    return Err(StateError::invalid(format!(
                        "run {}: seq {} is already used in tenant {}",
                        r.key.run_id, r.seq, r.key.tenant
                    )));
                }
                outcome(reply, || record, 0)?;
            }
            Entry::Session(s) => {
                let (h, _) = session_head(&s);
                let v = seal(&h, &session_tail(&s));
                agentstate_core::rules::check_size("session record", v.len(), self.max())?;
                let p = keys::tenant(&s.key.tenant);
                let mut conn = self.conn().await?;
                self.writable(&mut conn).await?;
                self.register(&mut conn, &s.key.tenant).await?;
                let reply: Reply = IMPORT
                    .key(keys::session(&p, &s.key.session_id))
                    .key(keys::sessions(&p))
                    .arg("session")
                    .arg(&s.key.session_id)
                    .arg(v)
                    .arg(s.version.to_string())
                    .arg(s.created_at.to_string())
                    .arg(&p)
                    .invoke(&mut conn)
                    .await?;
                outcome(reply, || record, 0)?;
            }
            Entry::Budget { budget, spent } => {
                let p = keys::tenant(&budget.key.tenant);
                let mut conn = self.conn().await?;
                self.writable(&mut conn).await?;
                self.register(&mut conn, &budget.key.tenant).await?;
                let reply: Reply = BUDGETS
                    .key(keys::budget(&p, &budget.key.name))
                    .key(keys::budgets(&p))
                    .arg("import_budget")
                    .arg(&p)
                    .arg(&budget.key.name)
                    .arg(budget.version.to_string())
                    .arg(budget.created_at.to_string())
                    .arg(budget.updated_at.to_string())
                    .arg(super::runs::caps_arg(&budget.caps))
                    .arg(spent.cost_micros.to_string())
                    .arg(spent.tokens.to_string())
                    .arg(spent.iterations.to_string())
                    .invoke(&mut conn)
                    .await?;
                outcome(reply, || record, 0)?;
            }
            Entry::Hold { run, hold } => {
                let p = keys::tenant(&run.tenant);
                let mut conn = self.conn().await?;
                self.writable(&mut conn).await?;
                let reply: Reply = BUDGETS
                    .key(keys::run(&p, &run.run_id))
                    .key(keys::holds(&p, &run.run_id))
                    .arg("import_hold")
                    .arg(&p)
                    .arg(&run.run_id)
                    .arg(&hold.id)
                    .arg(hold_value(&hold))
                    .invoke(&mut conn)
                    .await?;
                if reply.first().map(Vec::as_slice) == Some(b"norun") {
                    return Err(StateError::invalid(format!(
                        "hold {}: its run {}/{} is not in the import before it",
                        hold.id, run.tenant, run.run_id
                    )));
                }
                outcome(reply, || record, 0)?;
            }
            Entry::Epoch { instance, epoch } => {
                let reply = TrayCall::new(&instance, "import_epoch", epoch)
                    .run(self)
                    .await?;
                outcome(reply, || record, 0)?;
            }
            Entry::Tray { key, tray } => {
                let reply = TrayCall::new(&key.instance(), "import_tray", 0)
                    .tray(keys::tray_member_of(&key), &tray)
                    .run(self)
                    .await?;
                outcome(reply, || record, 0)?;
            }
            Entry::Alarm { instance, due_at } => {
                let reply = TrayCall::new(&instance, "import_alarm", 0)
                    .arg(keys::alarm_member(due_at, &instance))
                    .arg(due_at.to_string())
                    .run(self)
                    .await?;
                outcome(reply, || record, 0)?;
            }
        }
        Ok(())
    }

    async fn verify_impl(&self) -> Result<VerifyReport> {
        let mut rep = VerifyReport::default();
        let mut conn = self.conn().await?;
        let mut p_ = Vec::new();
        // What is there, key by key, against what the indexes and
        // registries promise: a lost key (evicted, deleted by hand) shows
        // up whichever side of the promise it was on.
        let census = self.census(&mut conn, &mut p_).await?;
        let registry = self.tenants(&mut conn).await?;
        let mut tenants: std::collections::BTreeSet<String> = registry.iter().cloned().collect();
        for t in &census.tenants {
            if tenants.insert(t.clone()) {
                p_.push(format!(
                    "tenant {t}: has keys but is missing from the tenant registry"
                ));
            }
        }
        if !census.secret && census.keys > 0 {
            p_.push(
                "the cursor secret is missing: cursors and feed positions handed out \
                 before no longer open"
                    .to_string(),
            );
        }
        for t in tenants {
            let p = keys::tenant(&t);
            let counter: Option<Vec<u8>> =
                cmd("GET").arg(keys::seq(&p)).query_on(&mut conn).await?;
            let counter = counter
                .map(|c| num(&c, "seq counter"))
                .transpose()?
                .unwrap_or(0);
            let mut label_entries = 0u64;
            let mut after = None;
            loop {
                let ids = self
                    .seq_after(&mut conn, &keys::runs(&p), after, CHUNK)
                    .await?;
                for (id, seq) in &ids {
                    after = Some(*seq);
                    rep.entries += 1;
                    rep.runs += 1;
                    let run_id = text(id);
                    let h: std::collections::HashMap<String, Vec<u8>> = cmd("HGETALL")
                        .arg(keys::run(&p, &run_id))
                        .query_on(&mut conn)
                        .await?;
                    let name = format!("run {t}/{run_id}");
                    let Some(v) = h.get("v") else {
                        p_.push(format!("{name}: listed in the seq index but missing"));
                        continue;
                    };
                    let r = match decode_run(v, &RunKey::new(t.clone(), run_id.clone())) {
                        Ok(r) => r,
                        Err(e) => {
                            p_.push(format!("{name}: {e}"));
                            continue;
                        }
                    };
                    let mirrors: [(&str, String); 11] = [
                        ("ver", r.version.to_string()),
                        ("seq", r.seq.to_string()),
                        ("st", keys::state_tag(r.state)),
                        ("ag", r.agent_name.clone()),
                        ("ca", r.created_at.to_string()),
                        ("ua", r.updated_at.to_string()),
                        ("mr", r.messages_read.to_string()),
                        ("it", r.usage.input_tokens.to_string()),
                        ("ot", r.usage.output_tokens.to_string()),
                        ("co", r.cost_micros.to_string()),
                        ("ir", r.iterations.to_string()),
                    ];
                    for (f, want) in mirrors {
                        if h.get(f).map(|v| v.as_slice()) != Some(want.as_bytes()) {
                            p_.push(format!("{name}: field {f} disagrees with the record"));
                        }
                    }
                    if h.get("ss").map(|v| text(v)) != r.session_id {
                        p_.push(format!("{name}: field ss disagrees with the record"));
                    }
                    let lb = keys::label_field(&r.labels);
                    if h.get("lb").map_or(&b""[..], |v| v.as_slice()) != lb.as_slice() {
                        p_.push(format!("{name}: field lb disagrees with the record"));
                    }
                    if r.seq != *seq || r.seq == 0 || r.seq > counter {
                        p_.push(format!(
                            "{name}: seq {} outside 1..={counter} or not its index score",
                            r.seq
                        ));
                    }
                    let mut want_in = vec![keys::by_state(&p, r.state)];
                    if let Some(s) = &r.session_id {
                        want_in.push(keys::by_session(&p, s));
                    }
                    let labelled = want_in.len();
                    for (k, v) in r.labels.iter() {
                        let suffix = keys::label_suffix(k, &agentstate_core::labels::canonical(v));
                        want_in.push(keys::by_label(&p, &suffix));
                    }
                    label_entries += r.labels.len() as u64;
                    for (i, idx) in want_in.into_iter().enumerate() {
                        let score: Option<f64> =
                            cmd("ZSCORE").arg(&idx).arg(id).query_on(&mut conn).await?;
                        if score != Some(r.seq as f64) {
                            p_.push(format!(
                                "{name}: {} index entry missing or wrong",
                                if i < labelled {
                                    "state or session"
                                } else {
                                    "label"
                                }
                            ));
                        }
                    }
                }
                if ids.len() < CHUNK {
                    break;
                }
            }
            if counter == 0 && census.counterless.contains(&t) {
                p_.push(format!(
                    "tenant {t}: its seq counter is missing (a new run would reuse a seq)"
                ));
            }
            self.indexed_runs_exist(&mut conn, &t, &p, &mut p_).await?;
            let runs = self.zcard(&mut conn, &keys::runs(&p)).await?;
            let mut by_state = 0;
            for st in RunState::ALL {
                by_state += self.zcard(&mut conn, &keys::by_state(&p, st)).await?;
            }
            if by_state != runs {
                p_.push(format!(
                    "tenant {t}: {by_state} state index entries for {runs} runs"
                ));
            }
            // Every label index entry is one of the labels counted above.
            let in_labels = self.label_index_entries(&mut conn, &p).await?;
            if in_labels != label_entries {
                p_.push(format!(
                    "tenant {t}: {in_labels} label index entries for {label_entries} labels of runs"
                ));
            }
            let mut after: Option<Vec<u8>> = None;
            loop {
                let ids = self
                    .lex_after(&mut conn, &keys::sessions(&p), after.as_deref(), CHUNK)
                    .await?;
                for id in &ids {
                    after = Some(id.clone());
                    rep.entries += 1;
                    rep.sessions += 1;
                    let sid = text(id);
                    match self.hget(&mut conn, &keys::session(&p, &sid), "v").await? {
                        None => p_.push(format!("session {t}/{sid}: listed but missing")),
                        Some(v) => {
                            if let Err(e) =
                                decode_session(&v, &SessionKey::new(t.clone(), sid.clone()))
                            {
                                p_.push(format!("session {t}/{sid}: {e}"));
                            }
                        }
                    }
                }
                if ids.len() < CHUNK {
                    break;
                }
            }
        }
        let mut marked = 0u64;
        let mut alarms = 0u64;
        let registered = self.instances(&mut conn).await?;
        let mut instances: std::collections::BTreeSet<Vec<u8>> =
            registered.iter().cloned().collect();
        for i in &census.instances {
            if instances.insert(i.clone()) {
                let (inst, _) = keys::read_inst(i)?;
                p_.push(format!(
                    "instance {}/{}: has keys but is missing from the instance registry",
                    inst.ns, inst.id
                ));
            }
        }
        for i in instances {
            let (inst, _) = keys::read_inst(&i)?;
            let name = format!("instance {}/{}", inst.ns, inst.id);
            let ih: std::collections::HashMap<String, Vec<u8>> = cmd("HGETALL")
                .arg(keys::instance(&i))
                .query_on(&mut conn)
                .await?;
            rep.entries += 1;
            if ih.get("ep").is_some_and(|e| num(e, "epoch").is_err()) {
                p_.push(format!("{name}: epoch undecodable"));
            }
            // Without its epoch, the next write at any epoch would pass
            // the fence.
            if !ih.contains_key("ep") && self.zcard(&mut conn, &keys::trays_of(&i)).await? > 0 {
                p_.push(format!("{name}: has trays but no epoch"));
            }
            if let (Some(al), Some(am)) = (ih.get("al"), ih.get("am")) {
                alarms += 1;
                rep.alarms += 1;
                let due = num(al, "alarm").unwrap_or(u64::MAX);
                let score: Option<f64> = cmd("ZSCORE")
                    .arg(keys::due())
                    .arg(am)
                    .query_on(&mut conn)
                    .await?;
                if score.is_none() || am != &keys::alarm_member(due, &inst) {
                    p_.push(format!("{name}: alarm without its due-index entry"));
                }
            }
            let mut after: Option<Vec<u8>> = None;
            loop {
                let members = self
                    .lex_after(&mut conn, &keys::trays_of(&i), after.as_deref(), CHUNK)
                    .await?;
                for m in &members {
                    after = Some(m.clone());
                    rep.entries += 1;
                    rep.trays += 1;
                    let mut tk = keys::tray_base(&i);
                    tk.extend_from_slice(m);
                    let Some(v) = self.hget(&mut conn, &tk, "v").await? else {
                        p_.push(format!("{name}: tray index names a missing tray"));
                        continue;
                    };
                    match decode_tray(&v) {
                        Err(e) => p_.push(format!("{name}: tray: {e}")),
                        Ok(t) if t.marked => {
                            marked += 1;
                            let mut full = i.clone();
                            full.extend_from_slice(m);
                            for idx in [keys::marked(), keys::marked_env(&t.env)] {
                                let s: Option<f64> = cmd("ZSCORE")
                                    .arg(&idx)
                                    .arg(&full)
                                    .query_on(&mut conn)
                                    .await?;
                                if s.is_none() {
                                    p_.push(format!(
                                        "{name}: marked tray missing from the sweeper's index"
                                    ));
                                }
                            }
                        }
                        Ok(_) => {}
                    }
                }
                if members.len() < CHUNK {
                    break;
                }
            }
        }
        let in_index = self.zcard(&mut conn, &keys::marked()).await?;
        if in_index != marked {
            p_.push(format!(
                "sweeper index has {in_index} entries for {marked} marked trays"
            ));
        }
        let due = self.zcard(&mut conn, &keys::due()).await?;
        if due != alarms {
            p_.push(format!("due index has {due} entries for {alarms} alarms"));
        }
        rep.problems = p_;
        Ok(rep)
    }
}

/// What the census of a store's keys found beyond what it reported.
#[derive(Default)]
struct Census {
    /// Keys of the store in all.
    keys: u64,
    /// Every tenant with at least one key.
    tenants: std::collections::BTreeSet<String>,
    /// Tenants with runs or run indexes but no `seq` counter key.
    counterless: std::collections::BTreeSet<String>,
    /// Every instance with a tray, a tray index or an instance hash.
    instances: std::collections::BTreeSet<Vec<u8>>,
    /// The cursor secret is there.
    secret: bool,
}

impl RedisStore {
    /// Walks every key of the store (`SCAN as:*`) and checks each record
    /// against the index that must name it: a run hash against its
    /// tenant's run index, a session hash against its session index, a
    /// tray hash against its instance's tray index and the instance
    /// registry. What it finds missing goes to `problems`; what the whole
    /// walk needs (tenants, counters, the secret) comes back.
    async fn census(&self, conn: &mut Conn, problems: &mut Vec<String>) -> Result<Census> {
        let mut c = Census::default();
        let mut with_runs = std::collections::BTreeSet::new();
        let mut with_counter = std::collections::BTreeSet::new();
        let trays = keys::all_tray_base();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<Vec<u8>>) = cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg("as:*")
                .arg("COUNT")
                .arg(1000)
                .query_on(conn)
                .await?;
            for k in batch {
                c.keys += 1;
                if k == keys::SECRET.as_bytes() {
                    c.secret = true;
                } else if let Some(rest) = k.strip_prefix(trays.as_slice()) {
                    let (inst, member) = keys::read_inst(rest)?;
                    let name = format!("tray of instance {}/{}", inst.ns, inst.id);
                    let i = keys::inst(&inst);
                    let in_trays: Option<f64> = cmd("ZSCORE")
                        .arg(keys::trays_of(&i))
                        .arg(member)
                        .query_on(conn)
                        .await?;
                    if in_trays.is_none() {
                        problems.push(format!("{name}: missing from its instance's tray index"));
                    }
                    c.instances.insert(i);
                } else if let Some(i) = k
                    .strip_prefix(keys::instance_base().as_slice())
                    .or_else(|| k.strip_prefix(keys::trays_of(b"").as_slice()))
                {
                    c.instances.insert(i.to_vec());
                } else if let Some((t, rest)) = tenant_key(&k) {
                    let p = keys::tenant(&t);
                    // A record's hash, and the index that must name it.
                    let indexed = if let Some(id) = rest.strip_prefix(b"r:") {
                        with_runs.insert(t.clone());
                        Some(("run", id, keys::runs(&p)))
                    } else {
                        rest.strip_prefix(b"s:")
                            .map(|id| ("session", id, keys::sessions(&p)))
                    };
                    if let Some((what, id, index)) = indexed {
                        let s: Option<f64> =
                            cmd("ZSCORE").arg(index).arg(id).query_on(conn).await?;
                        if s.is_none() {
                            problems.push(format!(
                                "{what} {t}/{}: missing from the tenant's {what} index",
                                text(id)
                            ));
                        }
                    } else if let Some(sid) = rest.strip_prefix(b"ss:") {
                        // A session's run index: the session is there
                        // while any of its runs is unfinished (S2 keeps it;
                        // one whose runs all finished may be deleted).
                        let there: bool = cmd("EXISTS")
                            .arg(keys::session(&p, &text(sid)))
                            .query_on(conn)
                            .await?;
                        if !there && self.any_unfinished(conn, &p, &k).await? {
                            problems.push(format!(
                                "session {t}/{}: runs name it but it is missing",
                                text(sid)
                            ));
                        }
                    } else if rest == b"seq" {
                        with_counter.insert(t.clone());
                    } else if rest == b"runs" || rest.starts_with(b"st:") {
                        with_runs.insert(t.clone());
                    }
                    c.tenants.insert(t);
                }
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        c.counterless = with_runs.difference(&with_counter).cloned().collect();
        Ok(c)
    }

    /// Every run a tenant's state and session indexes name has its record
    /// (the run index is checked record by record in `verify_impl`).
    async fn indexed_runs_exist(
        &self,
        conn: &mut Conn,
        t: &str,
        p: &[u8],
        problems: &mut Vec<String>,
    ) -> Result<()> {
        let mut indexes: Vec<Vec<u8>> = RunState::ALL
            .iter()
            .map(|&s| keys::by_state(p, s))
            .collect();
        indexes.extend(self.keys_under(conn, &keys::by_session(p, "")).await?);
        for idx in indexes {
            let mut after = None;
            loop {
                let ids = self.seq_after(conn, &idx, after, CHUNK).await?;
                for (id, seq) in &ids {
                    after = Some(*seq);
                    let there: bool = cmd("EXISTS")
                        .arg(keys::run(p, &text(id)))
                        .query_on(conn)
                        .await?;
                    if !there {
                        problems.push(format!(
                            "run {t}/{}: named by index {} but missing",
                            text(id),
                            text(&idx)
                        ));
                    }
                }
                if ids.len() < CHUNK {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Every key that starts with `prefix`, by `SCAN`.
    async fn keys_under(&self, conn: &mut Conn, prefix: &[u8]) -> Result<Vec<Vec<u8>>> {
        let pattern = scan_pattern(prefix);
        let mut out = std::collections::BTreeSet::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<Vec<u8>>) = cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_on(conn)
                .await?;
            out.extend(batch);
            cursor = next;
            if cursor == 0 {
                return Ok(out.into_iter().collect());
            }
        }
    }
}

/// A tenant's key read back: the tenant, and what follows its prefix
/// (`keys::tenant`). `None` for a key of no tenant.
fn tenant_key(k: &[u8]) -> Option<(String, &[u8])> {
    if k.starts_with(b"as:{trays}:") || k.starts_with(b"as:{meta}:") {
        return None;
    }
    let rest = k.strip_prefix(b"as:{")?;
    let mut r = KeyReader::new(rest, b't').ok()?;
    let t = r.str().ok()?;
    let after = r.rest().strip_prefix(b"}:")?;
    Some((t, after))
}

/// A `SCAN` pattern for every key starting with `prefix`.
fn scan_pattern(prefix: &[u8]) -> Vec<u8> {
    let mut pattern = Vec::with_capacity(prefix.len() + 8);
    for &b in prefix {
        if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
            pattern.push(b'\\');
        }
        pattern.push(b);
    }
    pattern.push(b'*');
    pattern
}

impl RedisStore {
    /// The entries of a tenant's label indexes (R11), in all: its `lb:`
    /// keys found by `SCAN`, each counted once.
    async fn label_index_entries(&self, conn: &mut Conn, p: &[u8]) -> Result<u64> {
        let pattern = scan_pattern(&keys::by_label(p, b""));
        let mut seen = std::collections::HashSet::new();
        let mut n = 0u64;
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<Vec<u8>>) = cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_on(conn)
                .await?;
            for k in batch {
                if seen.insert(k.clone()) {
                    n += self.zcard(conn, &k).await?;
                }
            }
            cursor = next;
            if cursor == 0 {
                return Ok(n);
            }
        }
    }
}
