//! Input checks, run on entry before anything reaches a backend (rule K,
//! and the ids of every key).

use crate::error::{Result, StateError};
use crate::labels::check_labels;
use crate::limits::{
    BATCH_OPS_MAX, EPOCH_MAX, ID_BYTES_MAX, PAGE_ITEMS_MAX, PENDING_TOOL_CALLS_MAX,
};
use crate::record::{RunKey, RunRecord, SessionKey, SessionRecord};
use crate::tray::{InstanceKey, Tray, TrayKey, TrayOp};

/// K1: ids are 1..=256 bytes of UTF-8 (UTF-8 is given by `&str`).
pub fn check_id(what: &str, id: &str) -> Result<()> {
    if id.is_empty() || id.len() > ID_BYTES_MAX {
        return Err(StateError::invalid(format!(
            "{what}: must be 1..={ID_BYTES_MAX} bytes, got {}",
            id.len()
        )));
    }
    Ok(())
}

/// K3: a page is 1..=1000 items.
pub fn check_limit(limit: usize) -> Result<()> {
    if limit == 0 || limit > PAGE_ITEMS_MAX {
        return Err(StateError::invalid(format!(
            "limit: must be 1..={PAGE_ITEMS_MAX}, got {limit}"
        )));
    }
    Ok(())
}

/// K2: an encoded value past the store's limit is `TooLarge`.
pub fn check_size(what: &str, bytes: usize, max: usize) -> Result<()> {
    if bytes > max {
        return Err(StateError::too_large(format!(
            "{what} is {bytes} bytes, the limit is {max}"
        )));
    }
    Ok(())
}

pub fn check_run_key(k: &RunKey) -> Result<()> {
    check_id("tenant", &k.tenant)?;
    check_id("run_id", &k.run_id)
}

pub fn check_session_key(k: &SessionKey) -> Result<()> {
    check_id("tenant", &k.tenant)?;
    check_id("session_id", &k.session_id)
}

/// The ids of a run record and its pending calls (K1, K5).
pub fn check_record(r: &RunRecord) -> Result<()> {
    check_run_key(&r.key)?;
    check_id("agent_name", &r.agent_name)?;
    if let Some(s) = &r.session_id {
        check_id("session_id", s)?;
    }
    if let Some(b) = &r.budget {
        check_id("budget", b)?;
    }
    if r.pending_tool_calls.len() > PENDING_TOOL_CALLS_MAX {
        return Err(StateError::invalid(format!(
            "pending_tool_calls: at most {PENDING_TOOL_CALLS_MAX}, got {}",
            r.pending_tool_calls.len()
        )));
    }
    check_labels(&r.labels)
}

/// A session record's key and labels (K1, R11).
pub fn check_session(s: &SessionRecord) -> Result<()> {
    check_session_key(&s.key)?;
    check_labels(&s.labels)
}

/// K7: an epoch a tray call carries is at most `EPOCH_MAX` (`i64::MAX`,
/// the seeds' `bigint`). Checked before the fence, so a refused call
/// never advances the stored epoch.
pub fn check_epoch(epoch: u64) -> Result<()> {
    if epoch > EPOCH_MAX {
        return Err(StateError::invalid(format!(
            "epoch: must be at most {EPOCH_MAX} (i64::MAX, the bigint epochs are stored in), got {epoch}"
        )));
    }
    Ok(())
}

pub fn check_instance(i: &InstanceKey) -> Result<()> {
    check_id("ns", &i.ns)?;
    check_id("id", &i.id)
}

pub fn check_tray_key(k: &TrayKey) -> Result<()> {
    check_id("ns", &k.ns)?;
    check_id("id", &k.id)?;
    check_tray_name(&k.tray_ns, &k.tray_id)
}

/// A tray's name within its instance: two ids (K1), and not the name the
/// seeds give an instance's alarm row, `("pinned", "alarm")` (A4: on
/// PostgreSQL that row is the alarm, for a sweeper reading the table).
pub fn check_tray_name(tray_ns: &str, tray_id: &str) -> Result<()> {
    check_id("tray_ns", tray_ns)?;
    check_id("tray_id", tray_id)?;
    if (tray_ns, tray_id) == crate::tray::ALARM_TRAY {
        return Err(StateError::invalid(
            "tray (\"pinned\", \"alarm\") is reserved: it is the instance's alarm (set_alarm)",
        ));
    }
    Ok(())
}

/// A tray names the worker that wrote it, so a sweeper knows whom to wake:
/// `env` and `hostname` are ids (K1), and the doc is bounded (K2).
pub fn check_tray(t: &Tray, max: usize) -> Result<()> {
    check_size("tray doc", t.doc.len(), max)?;
    check_id("env", &t.env)?;
    check_id("hostname", &t.hostname)
}

/// A tray batch: at most 10,000 ops (K4), every tray checked, and the docs
/// of one batch bounded by 64 records' worth, so one call cannot stall the
/// store.
pub fn check_batch(instance: &InstanceKey, ops: &[TrayOp], max: usize) -> Result<()> {
    check_instance(instance)?;
    if ops.len() > BATCH_OPS_MAX {
        return Err(StateError::invalid(format!(
            "batch: at most {BATCH_OPS_MAX} ops, got {}",
            ops.len()
        )));
    }
    let mut total = 0usize;
    for op in ops {
        let (tray_ns, tray_id) = match op {
            TrayOp::Put {
                tray_ns,
                tray_id,
                tray,
            } => {
                check_tray(tray, max)?;
                total += tray.doc.len();
                (tray_ns, tray_id)
            }
            TrayOp::Delete { tray_ns, tray_id } => (tray_ns, tray_id),
        };
        check_tray_name(tray_ns, tray_id)?;
    }
    check_size("tray batch docs", total, max.saturating_mul(64))
}
