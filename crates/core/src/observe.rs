//! What the store tells an operator, through the ecosystem's facades:
//! `tracing` spans and events, and `metrics` counters, histograms and
//! gauges. With no subscriber and no recorder installed, every one of these
//! is a check of a global and nothing more: nothing is formatted, nothing
//! allocated, nothing written.
//!
//! Spans carry the backend, the operation and, where the call names one,
//! the tenant; never a run, session or tray id (they may hold user data),
//! never a record's contents, never a connection string.
//!
//! | metric                               | kind      | labels                         |
//! |--------------------------------------|-----------|--------------------------------|
//! | `agentstate_calls_total`             | counter   | `backend`, `op`                |
//! | `agentstate_errors_total`            | counter   | `backend`, `op`, `kind`        |
//! | `agentstate_call_duration_seconds`   | histogram | `backend`, `op`                |
//! | `agentstate_retries_total`           | counter   | `backend`, `why`               |
//! | `agentstate_group_commit_size`       | histogram | (embedded stores)              |
//! | `agentstate_pool_connections`        | gauge     | `backend`, `state` (in_use, idle) |
//! | `agentstate_fast_path_declined_total`| counter   | `backend`, `op`                |
//!
//! Events: `debug` for a conflict, a refused budget and a serialization
//! retry; `info` for a lost fence (a worker was replaced); `warn` for a
//! refused connection, an unavailable server and an unknown outcome.

use std::future::Future;
use std::time::Instant;

use tracing::Instrument;

use crate::error::{PersistenceReason, Result, StateError};

/// The span of one call. Built before the call's arguments move (the
/// tenant is recorded at once; the span borrows nothing).
pub fn span(backend: &'static str, op: &'static str, tenant: Option<&str>) -> tracing::Span {
    match tenant {
        Some(tenant) => tracing::debug_span!("agentstate", backend, op, tenant),
        None => tracing::debug_span!("agentstate", backend, op),
    }
}

/// Runs one async call of `backend` inside its span, and counts it.
pub async fn call<T>(
    backend: &'static str,
    op: &'static str,
    tenant: Option<&str>,
    fut: impl Future<Output = Result<T>>,
) -> Result<T> {
    instrument(span(backend, op, tenant), backend, op, fut).await
}

/// Runs one async call inside `span` (made by [`span`] before the call's
/// arguments moved into `fut`), and counts it.
pub async fn instrument<T>(
    span: tracing::Span,
    backend: &'static str,
    op: &'static str,
    fut: impl Future<Output = Result<T>>,
) -> Result<T> {
    let start = Instant::now();
    let out = fut.instrument(span.clone()).await;
    span.in_scope(|| finish(backend, op, start, &out));
    out
}

pub fn call_sync<T>(
    span: tracing::Span,
    backend: &'static str,
    op: &'static str,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let start = Instant::now();
    span.in_scope(|| {
        let out = f();
        finish(backend, op, start, &out);
        out
    })
}

fn finish<T>(backend: &'static str, op: &'static str, start: Instant, out: &Result<T>) {
    metrics::counter!("agentstate_calls_total", "backend" => backend, "op" => op).increment(1);
    metrics::histogram!("agentstate_call_duration_seconds", "backend" => backend, "op" => op)
        .record(start.elapsed().as_secs_f64());
    let Err(e) = out else { return };
    metrics::counter!(
        "agentstate_errors_total",
        "backend" => backend,
        "op" => op,
        "kind" => e.kind_name()
    )
    .increment(1);
    match e {
        StateError::Conflict {
            expected, actual, ..
        } => {
            tracing::debug!(backend, op, expected, actual, "version conflict");
        }
        StateError::FenceLost { caller, stored, .. } => {
            tracing::info!(
                backend,
                op,
                caller,
                stored,
                "fence lost: a newer epoch holds the instance"
            );
        }
        StateError::BudgetExceeded { limit, .. } => {
            tracing::debug!(backend, op, limit = %limit, "budget exceeded");
        }
        StateError::Persistence { reason, detail, .. } => match reason {
            PersistenceReason::Refused => {
                tracing::warn!(backend, op, detail = detail.as_str(), "connection refused");
            }
            PersistenceReason::Unavailable => {
                tracing::warn!(backend, op, detail = detail.as_str(), "server unavailable");
            }
            PersistenceReason::OutcomeUnknown { keyed } => {
                tracing::warn!(
                    backend,
                    op,
                    keyed,
                    detail = detail.as_str(),
                    "outcome unknown"
                );
            }
            _ => tracing::warn!(backend, op, detail = detail.as_str(), "persistence failure"),
        },
        StateError::Corrupt { what } => {
            tracing::error!(backend, op, what = what.as_str(), "corrupt value");
        }
        _ => {}
    }
}

/// A transaction or script tried again (`why`: "serialization",
/// "deadlock", "redial", …).
pub fn retry(backend: &'static str, why: &'static str, attempt: u32) {
    tracing::debug!(backend, why, attempt, "trying the call again");
    metrics::counter!("agentstate_retries_total", "backend" => backend, "why" => why).increment(1);
}

/// A listed row left out because it does not decode (one another program
/// wrote with plain SQL); the listing goes on without it.
pub fn skipped_row(
    backend: &'static str,
    op: &'static str,
    row: &str,
    error: &crate::error::StateError,
) {
    tracing::warn!(backend, op, row, %error, "row left out of a listing");
    metrics::counter!("agentstate_rows_skipped_total", "backend" => backend, "op" => op)
        .increment(1);
}

/// A one-round-trip write whose guess the server declined (another
/// writer came first, or the call would be refused): the call goes on by
/// the locked path, one round trip dearer.
pub fn fast_path_declined(backend: &'static str, op: &'static str) {
    tracing::debug!(backend, op, "the one-round-trip guess was declined");
    metrics::counter!("agentstate_fast_path_declined_total", "backend" => backend, "op" => op)
        .increment(1);
}

/// One group commit of the embedded store, of `size` callers' writes.
pub fn group_commit(size: usize) {
    metrics::histogram!("agentstate_group_commit_size").record(size as f64);
}

/// A connection pool's state after a checkout.
pub fn pool(backend: &'static str, in_use: usize, idle: usize) {
    metrics::gauge!("agentstate_pool_connections", "backend" => backend, "state" => "in_use")
        .set(in_use as f64);
    metrics::gauge!("agentstate_pool_connections", "backend" => backend, "state" => "idle")
        .set(idle as f64);
}
