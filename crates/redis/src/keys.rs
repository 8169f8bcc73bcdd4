//! Key names and sorted-set members (see the table in `mod.rs`). Every id
//! inside a key is either its last component or escaped and terminated by
//! the key codec (`codec::key`), so no two keys share bytes (K6). Members of
//! lexicographic sorted sets use the key codec too, so their byte order is
//! the order of their components.

use agentstate_core::codec::key::KeyBuf;
use agentstate_core::record::RunState;
use agentstate_core::tray::{InstanceKey, TrayKey};

/// The cursor secret.
pub(crate) const SECRET: &str = "as:{meta}:secret";
/// Every tenant that has (or had) records, by name.
pub(crate) const TENANTS: &str = "as:{meta}:tenants";

/// `as:{t<tenant>}:`: the prefix, and hash tag, of every key of a tenant.
/// The `t` keeps the tag non-empty whatever the tenant.
pub(crate) fn tenant(t: &str) -> Vec<u8> {
    let mut k = b"as:{".to_vec();
    k.extend(KeyBuf::table(b't').str(t).done());
    k.extend_from_slice(b"}:");
    k
}

fn join(prefix: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut k = prefix.to_vec();
    for p in parts {
        k.extend_from_slice(p);
    }
    k
}

pub(crate) fn run(p: &[u8], run_id: &str) -> Vec<u8> {
    join(p, &[b"r:", run_id.as_bytes()])
}
pub(crate) fn seq(p: &[u8]) -> Vec<u8> {
    join(p, &[b"seq"])
}
pub(crate) fn runs(p: &[u8]) -> Vec<u8> {
    join(p, &[b"runs"])
}
pub(crate) fn by_state(p: &[u8], s: RunState) -> Vec<u8> {
    join(p, &[b"st:", state_tag(s).as_bytes()])
}
pub(crate) fn by_session(p: &[u8], session: &str) -> Vec<u8> {
    join(p, &[b"ss:", session.as_bytes()])
}
/// A label as a key suffix and `lb` entry: `<bytes of key>:<key><value>`,
/// the value its canonical JSON text (R11). The length says where the key
/// ends, so no two labels share a suffix.
pub(crate) fn label_suffix(key: &str, canonical: &str) -> Vec<u8> {
    let mut s = format!("{}:", key.len()).into_bytes();
    s.extend_from_slice(key.as_bytes());
    s.extend_from_slice(canonical.as_bytes());
    s
}
/// The runs carrying one label (its `label_suffix`), by `seq`.
pub(crate) fn by_label(p: &[u8], suffix: &[u8]) -> Vec<u8> {
    join(p, &[b"lb:", suffix])
}
/// A run's `lb` field: its label suffixes in key order, each as
/// `<bytes>:<suffix>`; empty when it has no labels. The scripts keep the
/// label indexes in step from it without decoding the record.
pub(crate) fn label_field(labels: &agentstate_core::Labels) -> Vec<u8> {
    let mut f = Vec::new();
    for (k, v) in labels.iter() {
        let s = label_suffix(k, &agentstate_core::labels::canonical(v));
        f.extend_from_slice(format!("{}:", s.len()).as_bytes());
        f.extend_from_slice(&s);
    }
    f
}
pub(crate) fn session(p: &[u8], session_id: &str) -> Vec<u8> {
    join(p, &[b"s:", session_id.as_bytes()])
}
pub(crate) fn sessions(p: &[u8]) -> Vec<u8> {
    join(p, &[b"sessions"])
}
/// The prefix of a tenant's session hashes (`session` without the id).
pub(crate) fn session_base(p: &[u8]) -> Vec<u8> {
    join(p, &[b"s:"])
}

/// A budget's hash (B1).
pub(crate) fn budget(p: &[u8], name: &str) -> Vec<u8> {
    join(p, &[b"b:", name.as_bytes()])
}
/// The holds of the runs drawing from a budget, by run and hold.
pub(crate) fn budget_holds(p: &[u8], name: &str) -> Vec<u8> {
    join(p, &[b"bh:", name.as_bytes()])
}
/// A tenant's budget names (a lexicographic sorted set).
pub(crate) fn budgets(p: &[u8]) -> Vec<u8> {
    join(p, &[b"budgets"])
}
/// A run's holds, by hold id.
pub(crate) fn holds(p: &[u8], run_id: &str) -> Vec<u8> {
    join(p, &[b"h:", run_id.as_bytes()])
}

/// The run ids of a tenant that have holds (a lexicographic sorted set).
pub(crate) fn holds_index(p: &[u8]) -> Vec<u8> {
    join(p, &[b"hr"])
}

/// A tenant's idempotency keys (a hash: key -> fingerprint, time, reply).
pub(crate) fn idem(p: &[u8]) -> Vec<u8> {
    join(p, &[b"ik"])
}
/// A tenant's idempotency keys by ordinal, oldest first (a sorted set).
pub(crate) fn idem_order(p: &[u8]) -> Vec<u8> {
    join(p, &[b"io"])
}

/// A state as the scripts see it: its tag in decimal.
pub(crate) fn state_tag(s: RunState) -> String {
    s.tag().to_string()
}

const TRAYS: &[u8] = b"as:{trays}:";

/// An instance as a member (of the instance index, and the head of a
/// marked-tray or alarm member).
pub(crate) fn inst(i: &InstanceKey) -> Vec<u8> {
    KeyBuf::table(b'i').str(&i.ns).str(&i.id).done()
}
/// A tray within its instance, as a member.
pub(crate) fn tray_member(tray_ns: &str, tray_id: &str) -> Vec<u8> {
    KeyBuf::table(b'y').str(tray_ns).str(tray_id).done()
}
/// The start of every member of one tray namespace (`tray_member`'s
/// first component).
pub(crate) fn tray_ns_prefix(tray_ns: &str) -> Vec<u8> {
    KeyBuf::table(b'y').str(tray_ns).done()
}
pub(crate) fn tray_member_of(k: &TrayKey) -> Vec<u8> {
    tray_member(&k.tray_ns, &k.tray_id)
}
/// An alarm's member in the due index: due_at big-endian, then the instance.
pub(crate) fn alarm_member(due_at: u64, i: &InstanceKey) -> Vec<u8> {
    let mut m = due_at.to_be_bytes().to_vec();
    m.extend(inst(i));
    m
}

pub(crate) fn instance(inst: &[u8]) -> Vec<u8> {
    join(TRAYS, &[b"i:", inst])
}
pub(crate) fn insts() -> Vec<u8> {
    join(TRAYS, &[b"insts"])
}
pub(crate) fn trays_of(inst: &[u8]) -> Vec<u8> {
    join(TRAYS, &[b"yz:", inst])
}
pub(crate) fn marked_of(inst: &[u8]) -> Vec<u8> {
    join(TRAYS, &[b"ym:", inst])
}
/// The prefix of an instance's tray hashes (a tray member follows).
pub(crate) fn tray_base(inst: &[u8]) -> Vec<u8> {
    join(TRAYS, &[b"y:", inst])
}
/// The prefix of every tray hash (an instance and tray member follow).
pub(crate) fn all_tray_base() -> Vec<u8> {
    join(TRAYS, &[b"y:"])
}
pub(crate) fn marked() -> Vec<u8> {
    join(TRAYS, &[b"m"])
}
/// The prefix of the per-env marked indexes (the env follows).
pub(crate) fn marked_env_base() -> Vec<u8> {
    join(TRAYS, &[b"me:"])
}
pub(crate) fn marked_env(env: &str) -> Vec<u8> {
    join(TRAYS, &[b"me:", env.as_bytes()])
}
pub(crate) fn due() -> Vec<u8> {
    join(TRAYS, &[b"a"])
}

/// The idempotency keys of an instance namespace's trays (as `idem`).
pub(crate) fn tray_idem(ns: &str) -> Vec<u8> {
    join(TRAYS, &[b"ik:", ns.as_bytes()])
}
/// Those keys by ordinal (as `idem_order`).
pub(crate) fn tray_idem_order(ns: &str) -> Vec<u8> {
    join(TRAYS, &[b"io:", ns.as_bytes()])
}

/// A tenant's change feed (see `lua/lib.lua`): its runs' and sessions'
/// members by position; the counter, horizon and channel are named after
/// it ([`feed_counter`], [`feed_horizon`], [`feed_channel`]).
pub(crate) fn feed(p: &[u8]) -> Vec<u8> {
    join(p, &[b"fd"])
}
/// The trays feed: every tray's and alarm's member by position.
pub(crate) fn trays_feed() -> Vec<u8> {
    join(TRAYS, &[b"fd"])
}
/// One env's trays by position (positions of the trays feed).
pub(crate) fn env_feed(env: &str) -> Vec<u8> {
    join(TRAYS, &[b"fd:e:", env.as_bytes()])
}
/// The counter a feed's positions are taken from.
pub(crate) fn feed_counter(fd: &[u8]) -> Vec<u8> {
    join(fd, &[b":n"])
}
/// A feed's horizon: a position before it may have lost tombstones.
pub(crate) fn feed_horizon(fd: &[u8]) -> Vec<u8> {
    join(fd, &[b":h"])
}
/// The channel a commit that changes a feed publishes on.
pub(crate) fn feed_channel(fd: &[u8]) -> Vec<u8> {
    join(fd, &[b":c"])
}
/// The channel of one env's trays.
pub(crate) fn env_channel(env: &str) -> Vec<u8> {
    join(TRAYS, &[b"fd:c:", env.as_bytes()])
}
/// The prefix of a tenant's run hashes (`run` without the id).
pub(crate) fn run_base(p: &[u8]) -> Vec<u8> {
    join(p, &[b"r:"])
}
/// The prefix of the instance hashes (an instance member follows).
pub(crate) fn instance_base() -> Vec<u8> {
    join(TRAYS, &[b"i:"])
}

/// Reads an instance member back (`inst`), returning the rest.
pub(crate) fn read_inst(m: &[u8]) -> agentstate_core::error::Result<(InstanceKey, &[u8])> {
    let mut r = agentstate_core::codec::key::KeyReader::new(m, b'i')?;
    let ns = r.str()?;
    let id = r.str()?;
    let rest = r.rest();
    Ok((InstanceKey { ns, id }, rest))
}

/// Reads a tray member back (`tray_member`).
pub(crate) fn read_tray_member(m: &[u8]) -> agentstate_core::error::Result<(String, String)> {
    let mut r = agentstate_core::codec::key::KeyReader::new(m, b'y')?;
    let t = (r.str()?, r.str()?);
    r.end()?;
    Ok(t)
}
