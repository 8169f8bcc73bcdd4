//! `agentstate_rs._native`: the agentstate crate as a Python extension
//! module (the `agentstate-rs` wheel). The Python package around it
//! (`pysrc/agentstate_rs`) adds the exception classes, the conformance
//! suite and the type stubs.

// No unsafe code of ours (PyO3's macros generate what the binding needs).
#![deny(unsafe_code)]
// Operating errors are raised as Python exceptions, never unwrapped: each
// remaining `expect` states the invariant that makes it unreachable.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use pyo3::prelude::*;

mod clock;
mod errors;
mod feed;
mod json;
mod pinned;
mod rt;
mod store;
mod types;

/// Masks the password of a PostgreSQL or Redis connection string.
#[pyfunction]
fn redact_connection_string(s: &str) -> String {
    agentstate::redact_connection_string(s)
}

/// What a store writes for a tool call's arguments (secrets redacted).
#[pyfunction]
fn scrub_arguments(arguments: &str) -> String {
    agentstate::Scrubber::default().scrub_arguments(arguments)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    use types::*;
    m.add_class::<store::StateStore>()?;
    m.add_class::<store::MemoryStateStore>()?;
    m.add_class::<store::FileStateStore>()?;
    m.add_class::<store::PostgresStateStore>()?;
    m.add_class::<store::RedisStateStore>()?;
    m.add_class::<store::SyncStateStore>()?;
    m.add_class::<clock::ManualClock>()?;
    m.add_class::<RunKey>()?;
    m.add_class::<SessionKey>()?;
    m.add_class::<BudgetKey>()?;
    m.add_class::<InstanceKey>()?;
    m.add_class::<TrayKey>()?;
    m.add_class::<RunState>()?;
    m.add_class::<Usage>()?;
    m.add_class::<ToolCall>()?;
    m.add_class::<Approval>()?;
    m.add_class::<Caps>()?;
    m.add_class::<RunRecord>()?;
    m.add_class::<StateDelta>()?;
    m.add_class::<StateQuery>()?;
    m.add_class::<Page>()?;
    m.add_class::<SessionRecord>()?;
    m.add_class::<Tray>()?;
    m.add_class::<TrayOp>()?;
    m.add_class::<MarkedTray>()?;
    m.add_class::<Alarm>()?;
    m.add_class::<Spend>()?;
    m.add_class::<BudgetRecord>()?;
    m.add_class::<BudgetStatus>()?;
    m.add_class::<Hold>()?;
    m.add_class::<HoldRecord>()?;
    m.add_class::<Settled>()?;
    m.add_class::<RunSpend>()?;
    m.add_class::<feed::FeedScope>()?;
    m.add_class::<feed::Change>()?;
    m.add_class::<feed::ChangePage>()?;
    m.add_class::<feed::ChangeStream>()?;
    m.add_class::<feed::SyncChangeStream>()?;
    m.add_class::<rt::Ready>()?;
    m.add_function(wrap_pyfunction!(redact_connection_string, m)?)?;
    m.add_function(wrap_pyfunction!(rt::_quiesce, m)?)?;
    m.add_function(wrap_pyfunction!(scrub_arguments, m)?)?;
    m.add("REDACTED", agentstate::REDACTED)?;
    Ok(())
}
