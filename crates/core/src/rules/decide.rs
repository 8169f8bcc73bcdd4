//! What a write stores, decided from what is stored: the version rules
//! (R2, S1), the amounts a put may not move (R6), commuting additions (R4),
//! and the checks an imported entry meets. Pure functions: the backend
//! reads, calls one of these, and writes the answer in the same atomic
//! step as the read.

use crate::entry::Entry;
use crate::error::{RecordKey, Result, StateError};
use crate::record::{Millis, RunRecord, SessionRecord, StateDelta};
use crate::scrub::Scrubber;

use super::budget::check_budget_key;
use super::check::{
    check_id, check_instance, check_record, check_run_key, check_session, check_tray,
    check_tray_key,
};

/// R2/S1: a write of `expected` against `stored` (the stored version, if
/// any) may go ahead, or is the `Conflict` that carries both numbers and
/// names the record (`record` is called only then).
pub fn check_version(
    expected: u64,
    stored: Option<u64>,
    record: impl FnOnce() -> RecordKey,
) -> Result<()> {
    match (expected, stored) {
        (0, None) => Ok(()),
        (n, Some(s)) if n == s && n > 0 => Ok(()),
        (n, s) => Err(StateError::Conflict {
            record: record(),
            expected: n,
            actual: s.unwrap_or(0),
        }),
    }
}

/// Whether `old` may be deleted (R10): at the version the caller states,
/// or, when it states none, only once the run is finished (`InUse` naming
/// it otherwise).
pub fn check_delete(old: &RunRecord, expected_version: Option<u64>) -> Result<()> {
    match expected_version {
        Some(v) if v == old.version => Ok(()),
        Some(v) => Err(StateError::Conflict {
            record: RecordKey::Run(old.key.clone()),
            expected: v,
            actual: old.version,
        }),
        None if old.state.is_finished() => Ok(()),
        None => Err(StateError::InUse {
            record: RecordKey::Run(old.key.clone()),
            runs: vec![old.key.clone()],
        }),
    }
}

/// A run as created: version 1, its `seq`, both times `now`.
pub fn created_run(mut record: RunRecord, seq: u64, now: Millis) -> RunRecord {
    created_run_in_place(&mut record, seq, now);
    record
}

/// [`created_run`], done to `record` where it is (a boxed record stays in
/// its box).
pub fn created_run_in_place(record: &mut RunRecord, seq: u64, now: Millis) {
    record.version = 1;
    record.seq = seq;
    record.created_at = now;
    record.updated_at = now;
}

/// R6: the accumulating field a put would move, if any.
pub fn moved_amount(stored: &RunRecord, new: &RunRecord) -> Option<&'static str> {
    if stored.usage != new.usage {
        Some("usage")
    } else if stored.cost_micros != new.cost_micros {
        Some("cost_micros")
    } else if stored.iterations != new.iterations {
        Some("iterations")
    } else if stored.messages_read != new.messages_read {
        Some("messages_read")
    } else {
        None
    }
}

/// A run as updated by a put whose version matched `stored` (R2, R6, R9;
/// the session is fixed at create).
pub fn updated_run(stored: &RunRecord, record: RunRecord, now: Millis) -> Result<RunRecord> {
    if stored.state.is_finished() && record.state != stored.state {
        return Err(StateError::invalid(format!(
            "state: run {} is {} and stays {} (a finished run is never moved to {}; R9)",
            stored.key.run_id,
            stored.state.as_str(),
            stored.state.as_str(),
            record.state.as_str()
        )));
    }
    if let Some(field) = moved_amount(stored, &record) {
        return Err(StateError::invalid(format!(
            "{field}: put_run cannot change an accumulating amount; use patch_run"
        )));
    }
    if stored.session_id != record.session_id {
        return Err(StateError::invalid("session_id: fixed at create"));
    }
    // B1: a run's caps and budget are fixed at create.
    if stored.caps != record.caps {
        return Err(StateError::invalid("caps: fixed at create"));
    }
    if stored.budget != record.budget {
        return Err(StateError::invalid("budget: fixed at create"));
    }
    Ok(RunRecord {
        version: stored.version + 1,
        seq: stored.seq,
        created_at: stored.created_at,
        updated_at: now,
        ..record
    })
}

fn add(field: &str, a: u64, b: u64) -> Result<u64> {
    a.checked_add(b)
        .ok_or_else(|| StateError::invalid(format!("{field}: adding {b} to {a} overflows u64")))
}

/// R4: `old` plus `delta`, one version later; an overflow is `Invalid` and
/// nothing is written.
pub fn patched_run(old: &RunRecord, delta: &StateDelta, now: Millis) -> Result<RunRecord> {
    let mut new = old.clone();
    new.usage.input_tokens = add(
        "usage.input_tokens",
        old.usage.input_tokens,
        delta.usage.input_tokens,
    )?;
    new.usage.output_tokens = add(
        "usage.output_tokens",
        old.usage.output_tokens,
        delta.usage.output_tokens,
    )?;
    new.cost_micros = add("cost_micros", old.cost_micros, delta.cost_micros)?;
    new.iterations = add("iterations", old.iterations, delta.iterations)?;
    new.messages_read = add("messages_read", old.messages_read, delta.messages_read)?;
    new.version = old.version + 1;
    new.updated_at = now;
    Ok(new)
}

/// S1: a session as written by a put whose version matched `stored`.
pub fn next_session(
    stored: Option<&SessionRecord>,
    record: SessionRecord,
    now: Millis,
) -> Result<SessionRecord> {
    check_version(record.version, stored.map(|s| s.version), || {
        RecordKey::Session(record.key.clone())
    })?;
    Ok(match stored {
        None => SessionRecord {
            version: 1,
            created_at: now,
            updated_at: now,
            ..record
        },
        Some(s) => SessionRecord {
            version: s.version + 1,
            created_at: s.created_at,
            updated_at: now,
            ..record
        },
    })
}

/// An imported entry meets every rule a write meets: ids (K1), sizes (K2),
/// pending calls (K5), and scrubbing (X1). Returns the entry to store.
pub fn checked_entry(e: Entry, scrubber: &Scrubber, max: usize) -> Result<Entry> {
    check_entry(&e, Some(max))?;
    Ok(match e {
        Entry::Run(r) => Entry::Run(scrubber.scrub_run_owned(r)),
        Entry::Session(mut s) => {
            scrubber.scrub_session_in_place(&mut s);
            Entry::Session(s)
        }
        other => other,
    })
}

/// What an import checks of one entry alone: ids (K1), pending calls (K5),
/// a run's `seq` and `version` and a budget's `version` at least 1, and,
/// given the store's limit, a tray doc's size (K2).
pub fn check_entry(e: &Entry, max: Option<usize>) -> Result<()> {
    match e {
        Entry::Run(r) => {
            check_record(r)?;
            if r.seq == 0 || r.version == 0 {
                return Err(StateError::invalid(format!(
                    "run {}: seq and version must be at least 1",
                    r.key.run_id
                )));
            }
        }
        Entry::Session(s) => check_session(s)?,
        Entry::Epoch { instance, .. } | Entry::Alarm { instance, .. } => check_instance(instance)?,
        Entry::Tray { key, tray } => {
            check_tray_key(key)?;
            check_tray(tray, max.unwrap_or(usize::MAX))?;
        }
        Entry::Budget { budget, .. } => {
            check_budget_key(&budget.key)?;
            if budget.version == 0 {
                return Err(StateError::invalid(format!(
                    "budget {}: version must be at least 1",
                    budget.key.name
                )));
            }
        }
        Entry::Hold { run, hold } => {
            check_run_key(run)?;
            check_id("hold id", &hold.id)?;
        }
    }
    Ok(())
}

/// The entries of one import name each record once, and each tenant's
/// runs have distinct `seq`s. A backend that writes an import entry by
/// entry checks this first, so a duplicate is refused before anything is
/// written (into an empty store, nothing else can collide).
pub fn check_import_unique(entries: &[Entry]) -> Result<()> {
    use std::collections::HashSet;
    // An instance's epoch and its alarm are two entries of one key: the
    // entry's kind is part of what must be unique.
    let mut seen: HashSet<(std::mem::Discriminant<Entry>, RecordKey)> = HashSet::new();
    let mut seqs: HashSet<(&str, u64)> = HashSet::new();
    for e in entries {
        if let Entry::Run(r) = e
            && !seqs.insert((&r.key.tenant, r.seq))
        {
            return Err(StateError::invalid(format!(
                "run {}: seq {} is already used in tenant {}",
                r.key.run_id, r.seq, r.key.tenant
            )));
        }
        let record = e.record_key();
        if !seen.insert((std::mem::discriminant(e), record.clone())) {
            return Err(StateError::Conflict {
                record,
                expected: 0,
                actual: 1,
            });
        }
    }
    Ok(())
}
