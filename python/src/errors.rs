//! `agentstate::StateError` as the package's exception classes.
//!
//! The classes are plain Python (`agentstate_rs/errors.py`), so a store
//! written in Python raises the same ones with the same attributes. Every
//! one carries the Rust error's message (`str(e)`).

use agentstate::{CapScope, Missing, PersistenceReason, StateError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::types::{BudgetKey, RunKey, SessionKey};

/// The class `name` of `agentstate_rs.errors`.
pub fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("agentstate_rs.errors")?.getattr(name)
}

/// An exception of the class `name` with `message` and keyword attributes.
pub fn raise(py: Python<'_>, name: &str, message: &str, kw: &Bound<'_, PyDict>) -> PyErr {
    match class(py, name).and_then(|c| c.call((message,), Some(kw))) {
        Ok(obj) => PyErr::from_value(obj),
        Err(e) => e,
    }
}

/// `StateInvalidError(message)`: bad input found on the Python side.
pub fn invalid(py: Python<'_>, message: impl AsRef<str>) -> PyErr {
    raise(py, "StateInvalidError", message.as_ref(), &PyDict::new(py))
}

/// `FenceLostError` (the subclass pinned's `FenceLost` also catches when
/// pinned is imported): `caller` may be an epoch no store accepts (a
/// negative one), so it is any Python int.
pub fn fence_lost<'py>(
    py: Python<'py>,
    message: &str,
    caller: impl IntoPyObject<'py>,
    stored: u64,
    key: &str,
) -> PyErr {
    let made = py
        .import("agentstate_rs.errors")
        .and_then(|m| m.getattr("_fence_lost"))
        .and_then(|f| f.call1((message, caller, stored, key)));
    match made {
        Ok(obj) => PyErr::from_value(obj),
        Err(e) => e,
    }
}

/// The store was opened in another process (before a fork).
pub fn forked(py: Python<'_>, what: &str) -> PyErr {
    raise(
        py,
        "StoreForkedError",
        &format!(
            "{what} was opened in its parent process and cannot be used in this forked child: \
             its runtime threads, connections and file locks stayed with the parent; \
             open a new store in the child"
        ),
        &PyDict::new(py),
    )
}

/// The name of a persistence reason, as the seeds spell them.
pub fn reason_name(reason: PersistenceReason) -> (&'static str, bool) {
    match reason {
        PersistenceReason::Unavailable => ("unavailable", false),
        PersistenceReason::OutcomeUnknown { keyed } => ("outcome_unknown", keyed),
        PersistenceReason::TooLarge => ("too_large", false),
        PersistenceReason::ReadOnly => ("read_only", false),
        PersistenceReason::Refused => ("refused", false),
        PersistenceReason::InvalidPath => ("invalid_path", false),
        _ => ("unknown", false),
    }
}

/// Converts a store error (takes the GIL for the moment it needs it).
pub fn to_py(e: StateError) -> PyErr {
    Python::attach(|py| build(py, e).unwrap_or_else(|err| err))
}

/// What kind of record an error names, and its key where Python has a
/// type for it.
fn record_of(py: Python<'_>, record: Missing) -> PyResult<(&'static str, Option<Py<PyAny>>)> {
    Ok(match record {
        Missing::Run(k) => ("run", Some(Py::new(py, RunKey::from(k))?.into_any())),
        Missing::Session(k) => (
            "session",
            Some(Py::new(py, SessionKey::from(k))?.into_any()),
        ),
        Missing::Tray(_) => ("tray", None),
        Missing::Budget(k) => ("budget", Some(Py::new(py, BudgetKey::from(k))?.into_any())),
        Missing::Hold { run, .. } => ("hold", Some(Py::new(py, RunKey::from(run))?.into_any())),
        _ => ("record", None),
    })
}

fn build(py: Python<'_>, e: StateError) -> PyResult<PyErr> {
    let message = e.to_string();
    let kw = PyDict::new(py);
    let name = match e {
        StateError::Conflict {
            record,
            expected,
            actual,
        } => {
            kw.set_item("expected_version", expected)?;
            kw.set_item("actual_version", actual)?;
            let (what, key) = record_of(py, record)?;
            kw.set_item("what", what)?;
            kw.set_item("key", key)?;
            "StateConflictError"
        }
        StateError::NotFound(missing) => {
            let (what, key) = record_of(py, missing)?;
            kw.set_item("what", what)?;
            kw.set_item("key", key)?;
            "StateNotFoundError"
        }
        StateError::Persistence { reason, .. } => {
            let (name, keyed) = reason_name(reason);
            kw.set_item("reason", name)?;
            kw.set_item("keyed", keyed)?;
            "StatePersistenceError"
        }
        StateError::InUse { runs, .. } => {
            let runs: Vec<RunKey> = runs.into_iter().map(RunKey::from).collect();
            kw.set_item("runs", runs)?;
            "StateInUseError"
        }
        StateError::FenceLost {
            instance,
            caller,
            stored,
        } => {
            let key = format!("{}/{}", instance.ns, instance.id);
            return Ok(fence_lost(py, &message, caller, stored, &key));
        }
        StateError::BudgetExceeded {
            limit,
            spent,
            held,
            asked,
        } => {
            match limit.scope {
                CapScope::Run(k) => {
                    kw.set_item("scope", "run")?;
                    kw.set_item("run", RunKey::from(k))?;
                }
                CapScope::Budget(k) => {
                    kw.set_item("scope", "budget")?;
                    kw.set_item("budget", BudgetKey::from(k))?;
                }
                _ => kw.set_item("scope", "unknown")?,
            }
            kw.set_item("amount", limit.amount.as_str())?;
            kw.set_item("max", limit.max)?;
            kw.set_item("spent", spent)?;
            kw.set_item("held", held)?;
            kw.set_item("asked", asked)?;
            "BudgetExceededError"
        }
        StateError::FeedPruned { scope, horizon } => {
            kw.set_item("scope", crate::feed::FeedScope::from(scope))?;
            kw.set_item("horizon", horizon.as_u128())?;
            "StateFeedPrunedError"
        }
        StateError::Invalid { .. } => "StateInvalidError",
        StateError::Corrupt { .. } => "StateCorruptError",
        StateError::UnsupportedFormat { found, supported } => {
            kw.set_item("found", found)?;
            kw.set_item("supported", supported)?;
            "StateUnsupportedFormatError"
        }
        StateError::Locked { path, this_process } => {
            kw.set_item("path", path.display().to_string())?;
            kw.set_item("this_process", this_process)?;
            "StateLockedError"
        }
        _ => "StateError",
    };
    Ok(raise(py, name, &message, &kw))
}
