//! The records, keys and queries, as Python classes over the crate's types.

use std::collections::BTreeMap;

use agentstate as a;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors;

/// A non-negative amount: the seeds refuse negative ones (a negative
/// amount is how one worker unspends what another spent).
pub fn amount(py: Python<'_>, v: i128, what: &str) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| {
        errors::invalid(
            py,
            format!("{what}: must be a non-negative integer below 2**64, got {v}"),
        )
    })
}

fn opt_repr<T: std::fmt::Debug>(v: &Option<T>) -> String {
    match v {
        Some(v) => format!("{v:?}"),
        None => "None".into(),
    }
}

/// A Python value as JSON: what `json.dumps` takes (NaN refused), as the
/// crate's JSON value.
fn json_in(py: Python<'_>, v: &Bound<'_, PyAny>, what: &str) -> PyResult<serde_json::Value> {
    let kwargs = PyDict::new(py);
    kwargs.set_item("allow_nan", false)?;
    let text: String = py
        .import("json")?
        .call_method("dumps", (v,), Some(&kwargs))
        .map_err(|e| errors::invalid(py, format!("{what}: not a JSON value ({e})")))?
        .extract()?;
    serde_json::from_str(&text).map_err(|e| errors::invalid(py, format!("{what}: {e}")))
}

/// JSON text as Python objects (`json.loads`).
#[allow(clippy::expect_used, reason = "JSON values always serialize")]
fn json_out(py: Python<'_>, text: serde_json::Result<String>) -> PyResult<Py<PyAny>> {
    let text = text.expect("JSON values always serialize");
    Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
}

/// Labels from a dict of string keys to JSON values (`None`: none).
fn labels_in(py: Python<'_>, v: Option<&Bound<'_, PyAny>>) -> PyResult<a::Labels> {
    let Some(v) = v.filter(|v| !v.is_none()) else {
        return Ok(a::Labels::new());
    };
    if !v.is_instance_of::<PyDict>() {
        return Err(errors::invalid(
            py,
            "labels: must be a dict of str to JSON values",
        ));
    }
    match json_in(py, v, "labels")? {
        serde_json::Value::Object(m) => Ok(m.into_iter().collect()),
        _ => Err(errors::invalid(
            py,
            "labels: must be a dict of str to JSON values",
        )),
    }
}

// --- keys -------------------------------------------------------------

/// A run's key: the tenant is part of it.
#[pyclass(frozen, eq, hash, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RunKey {
    #[pyo3(get)]
    pub tenant: String,
    #[pyo3(get)]
    pub run_id: String,
}

#[pymethods]
impl RunKey {
    /// Pickles as the class and its fields (an exception carrying the
    /// key crosses a process: multiprocessing, celery).
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> (Bound<'py, pyo3::types::PyType>, (String, String)) {
        let me = slf.get();
        (slf.get_type(), (me.tenant.clone(), me.run_id.clone()))
    }
    #[new]
    #[pyo3(signature = (tenant, run_id))]
    fn new(tenant: String, run_id: String) -> Self {
        RunKey { tenant, run_id }
    }
    fn __repr__(&self) -> String {
        format!("RunKey(tenant={:?}, run_id={:?})", self.tenant, self.run_id)
    }
    fn __str__(&self) -> String {
        format!("{}/{}", self.tenant, self.run_id)
    }
}

impl From<a::RunKey> for RunKey {
    fn from(k: a::RunKey) -> Self {
        RunKey {
            tenant: k.tenant,
            run_id: k.run_id,
        }
    }
}
impl From<RunKey> for a::RunKey {
    fn from(k: RunKey) -> Self {
        a::RunKey::new(k.tenant, k.run_id)
    }
}

/// A session's key.
#[pyclass(frozen, eq, hash, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct SessionKey {
    #[pyo3(get)]
    pub tenant: String,
    #[pyo3(get)]
    pub session_id: String,
}

#[pymethods]
impl SessionKey {
    /// Pickles as the class and its fields (an exception carrying the
    /// key crosses a process: multiprocessing, celery).
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> (Bound<'py, pyo3::types::PyType>, (String, String)) {
        let me = slf.get();
        (slf.get_type(), (me.tenant.clone(), me.session_id.clone()))
    }
    #[new]
    fn new(tenant: String, session_id: String) -> Self {
        SessionKey { tenant, session_id }
    }
    fn __repr__(&self) -> String {
        format!(
            "SessionKey(tenant={:?}, session_id={:?})",
            self.tenant, self.session_id
        )
    }
}

impl From<a::SessionKey> for SessionKey {
    fn from(k: a::SessionKey) -> Self {
        SessionKey {
            tenant: k.tenant,
            session_id: k.session_id,
        }
    }
}
impl From<SessionKey> for a::SessionKey {
    fn from(k: SessionKey) -> Self {
        a::SessionKey::new(k.tenant, k.session_id)
    }
}

/// A named tenant budget's key.
#[pyclass(frozen, eq, hash, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct BudgetKey {
    #[pyo3(get)]
    pub tenant: String,
    #[pyo3(get)]
    pub name: String,
}

#[pymethods]
impl BudgetKey {
    /// Pickles as the class and its fields (an exception carrying the
    /// key crosses a process: multiprocessing, celery).
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> (Bound<'py, pyo3::types::PyType>, (String, String)) {
        let me = slf.get();
        (slf.get_type(), (me.tenant.clone(), me.name.clone()))
    }
    #[new]
    fn new(tenant: String, name: String) -> Self {
        BudgetKey { tenant, name }
    }
    fn __repr__(&self) -> String {
        format!("BudgetKey(tenant={:?}, name={:?})", self.tenant, self.name)
    }
}

impl From<a::BudgetKey> for BudgetKey {
    fn from(k: a::BudgetKey) -> Self {
        BudgetKey {
            tenant: k.tenant,
            name: k.name,
        }
    }
}
impl From<BudgetKey> for a::BudgetKey {
    fn from(k: BudgetKey) -> Self {
        a::BudgetKey::new(k.tenant, k.name)
    }
}

/// A pinned worker's instance: `(ns, id)`.
#[pyclass(frozen, eq, hash, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct InstanceKey {
    #[pyo3(get)]
    pub ns: String,
    #[pyo3(get)]
    pub id: String,
}

#[pymethods]
impl InstanceKey {
    /// Pickles as the class and its fields (an exception carrying the
    /// key crosses a process: multiprocessing, celery).
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> (Bound<'py, pyo3::types::PyType>, (String, String)) {
        let me = slf.get();
        (slf.get_type(), (me.ns.clone(), me.id.clone()))
    }
    #[new]
    fn new(ns: String, id: String) -> Self {
        InstanceKey { ns, id }
    }
    /// The key of one of this instance's trays.
    fn tray(&self, tray_ns: String, tray_id: String) -> TrayKey {
        TrayKey {
            ns: self.ns.clone(),
            id: self.id.clone(),
            tray_ns,
            tray_id,
        }
    }
    fn __repr__(&self) -> String {
        format!("InstanceKey(ns={:?}, id={:?})", self.ns, self.id)
    }
}

impl From<a::InstanceKey> for InstanceKey {
    fn from(k: a::InstanceKey) -> Self {
        InstanceKey { ns: k.ns, id: k.id }
    }
}
impl From<InstanceKey> for a::InstanceKey {
    fn from(k: InstanceKey) -> Self {
        a::InstanceKey::new(k.ns, k.id)
    }
}

/// One tray: `(ns, id, tray_ns, tray_id)`.
#[pyclass(frozen, eq, hash, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TrayKey {
    #[pyo3(get)]
    pub ns: String,
    #[pyo3(get)]
    pub id: String,
    #[pyo3(get)]
    pub tray_ns: String,
    #[pyo3(get)]
    pub tray_id: String,
}

#[pymethods]
impl TrayKey {
    /// Pickles as the class and its fields (an exception carrying the
    /// key crosses a process: multiprocessing, celery).
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> (
        Bound<'py, pyo3::types::PyType>,
        (String, String, String, String),
    ) {
        let me = slf.get();
        (
            slf.get_type(),
            (
                me.ns.clone(),
                me.id.clone(),
                me.tray_ns.clone(),
                me.tray_id.clone(),
            ),
        )
    }
    #[new]
    fn new(ns: String, id: String, tray_ns: String, tray_id: String) -> Self {
        TrayKey {
            ns,
            id,
            tray_ns,
            tray_id,
        }
    }
    /// The instance the tray belongs to.
    #[getter]
    fn instance(&self) -> InstanceKey {
        InstanceKey {
            ns: self.ns.clone(),
            id: self.id.clone(),
        }
    }
    fn __repr__(&self) -> String {
        format!(
            "TrayKey(ns={:?}, id={:?}, tray_ns={:?}, tray_id={:?})",
            self.ns, self.id, self.tray_ns, self.tray_id
        )
    }
}

impl From<a::TrayKey> for TrayKey {
    fn from(k: a::TrayKey) -> Self {
        TrayKey {
            ns: k.ns,
            id: k.id,
            tray_ns: k.tray_ns,
            tray_id: k.tray_id,
        }
    }
}
impl From<TrayKey> for a::TrayKey {
    fn from(k: TrayKey) -> Self {
        a::TrayKey {
            ns: k.ns,
            id: k.id,
            tray_ns: k.tray_ns,
            tray_id: k.tray_id,
        }
    }
}

// --- run records -----------------------------------------------------

/// Where a run is.
#[pyclass(eq, eq_int, frozen, hash, from_py_object, module = "agentstate_rs")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(clippy::upper_case_acronyms, non_camel_case_types)]
pub enum RunState {
    PENDING,
    RUNNING,
    AWAITING_APPROVAL,
    PAUSED,
    COMPLETED,
    FAILED,
    CANCELLED,
}

#[pymethods]
impl RunState {
    /// The state's name as the crate writes it (`"running"`).
    #[getter]
    fn value(&self) -> &'static str {
        a::RunState::from(*self).as_str()
    }
    /// Completed, failed or cancelled.
    #[getter]
    fn is_finished(&self) -> bool {
        a::RunState::from(*self).is_finished()
    }
    fn __str__(&self) -> &'static str {
        self.value()
    }
}

impl From<RunState> for a::RunState {
    fn from(s: RunState) -> Self {
        match s {
            RunState::PENDING => a::RunState::Pending,
            RunState::RUNNING => a::RunState::Running,
            RunState::AWAITING_APPROVAL => a::RunState::AwaitingApproval,
            RunState::PAUSED => a::RunState::Paused,
            RunState::COMPLETED => a::RunState::Completed,
            RunState::FAILED => a::RunState::Failed,
            RunState::CANCELLED => a::RunState::Cancelled,
        }
    }
}
impl From<a::RunState> for RunState {
    fn from(s: a::RunState) -> Self {
        match s {
            a::RunState::Pending => RunState::PENDING,
            a::RunState::Running => RunState::RUNNING,
            a::RunState::AwaitingApproval => RunState::AWAITING_APPROVAL,
            a::RunState::Paused => RunState::PAUSED,
            a::RunState::Completed => RunState::COMPLETED,
            a::RunState::Failed => RunState::FAILED,
            a::RunState::Cancelled => RunState::CANCELLED,
        }
    }
}

/// Tokens.
#[pyclass(frozen, eq, from_py_object, module = "agentstate_rs")]
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    #[pyo3(get)]
    pub input_tokens: u64,
    #[pyo3(get)]
    pub output_tokens: u64,
}

#[pymethods]
impl Usage {
    #[new]
    #[pyo3(signature = (input_tokens=0, output_tokens=0))]
    fn new(py: Python<'_>, input_tokens: i128, output_tokens: i128) -> PyResult<Self> {
        Ok(Usage {
            input_tokens: amount(py, input_tokens, "input_tokens")?,
            output_tokens: amount(py, output_tokens, "output_tokens")?,
        })
    }
    fn __repr__(&self) -> String {
        format!(
            "Usage(input_tokens={}, output_tokens={})",
            self.input_tokens, self.output_tokens
        )
    }
}

impl From<a::Usage> for Usage {
    fn from(u: a::Usage) -> Self {
        Usage {
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
        }
    }
}
impl From<Usage> for a::Usage {
    fn from(u: Usage) -> Self {
        a::Usage {
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
        }
    }
}

/// A tool call asked for and not yet answered.
#[pyclass(frozen, eq, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq, Eq)]
pub struct ToolCall {
    #[pyo3(get)]
    pub id: String,
    #[pyo3(get)]
    pub name: String,
    #[pyo3(get)]
    pub arguments: String,
}

#[pymethods]
impl ToolCall {
    #[new]
    #[pyo3(signature = (id, name, arguments="{}".to_string()))]
    fn new(id: String, name: String, arguments: String) -> Self {
        ToolCall {
            id,
            name,
            arguments,
        }
    }
    fn __repr__(&self) -> String {
        // Arguments may hold secrets before a store scrubbed them: their
        // size only.
        format!(
            "ToolCall(id={:?}, name={:?}, arguments=<{} bytes>)",
            self.id,
            self.name,
            self.arguments.len()
        )
    }
}

impl From<a::ToolCall> for ToolCall {
    fn from(t: a::ToolCall) -> Self {
        ToolCall {
            id: t.id,
            name: t.name,
            arguments: t.arguments,
        }
    }
}
impl From<ToolCall> for a::ToolCall {
    fn from(t: ToolCall) -> Self {
        a::ToolCall {
            id: t.id,
            name: t.name,
            arguments: t.arguments,
        }
    }
}

/// The approval a run is held on.
#[pyclass(frozen, eq, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq, Eq)]
pub struct Approval {
    #[pyo3(get)]
    pub id: String,
    #[pyo3(get)]
    pub prompt: String,
}

#[pymethods]
impl Approval {
    #[new]
    fn new(id: String, prompt: String) -> Self {
        Approval { id, prompt }
    }
    fn __repr__(&self) -> String {
        format!("Approval(id={:?}, prompt={:?})", self.id, self.prompt)
    }
}

/// Spend caps of a run or a budget (None: no cap).
#[pyclass(frozen, eq, from_py_object, module = "agentstate_rs")]
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct Caps {
    #[pyo3(get)]
    pub cost_micros_max: Option<u64>,
    #[pyo3(get)]
    pub tokens_max: Option<u64>,
    #[pyo3(get)]
    pub iterations_max: Option<u64>,
}

#[pymethods]
impl Caps {
    #[new]
    #[pyo3(signature = (cost_micros_max=None, tokens_max=None, iterations_max=None))]
    fn new(
        cost_micros_max: Option<u64>,
        tokens_max: Option<u64>,
        iterations_max: Option<u64>,
    ) -> Self {
        Caps {
            cost_micros_max,
            tokens_max,
            iterations_max,
        }
    }
    fn __repr__(&self) -> String {
        format!(
            "Caps(cost_micros_max={}, tokens_max={}, iterations_max={})",
            opt_repr(&self.cost_micros_max),
            opt_repr(&self.tokens_max),
            opt_repr(&self.iterations_max)
        )
    }
}

impl From<a::Caps> for Caps {
    fn from(c: a::Caps) -> Self {
        Caps {
            cost_micros_max: c.cost_micros_max,
            tokens_max: c.tokens_max,
            iterations_max: c.iterations_max,
        }
    }
}
impl From<Caps> for a::Caps {
    fn from(c: Caps) -> Self {
        a::Caps {
            cost_micros_max: c.cost_micros_max,
            tokens_max: c.tokens_max,
            iterations_max: c.iterations_max,
        }
    }
}

/// What a run is: enough to resume, and no more.
///
/// `version` is the version it was read at: 0 creates, n updates at n + 1.
#[pyclass(eq, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq)]
pub struct RunRecord {
    pub inner: a::RunRecord,
}

macro_rules! rw {
    ($($get:ident / $set:ident : $ty:ty => $field:ident),* $(,)?) => {
        #[pymethods]
        impl RunRecord {
            $(
                #[getter]
                fn $get(&self) -> $ty {
                    self.inner.$field.clone().into()
                }
                #[setter]
                fn $set(&mut self, v: $ty) {
                    self.inner.$field = v.into();
                }
            )*
        }
    };
}

rw! {
    agent_name / set_agent_name: String => agent_name,
    session_id / set_session_id: Option<String> => session_id,
    budget / set_budget: Option<String> => budget,
    state / set_state: RunState => state,
    usage / set_usage: Usage => usage,
    caps / set_caps: Caps => caps,
}

#[pymethods]
impl RunRecord {
    #[new]
    #[pyo3(signature = (
        run_id, tenant, agent_name, *, state=RunState::PENDING, session_id=None,
        messages_read=0, pending_tool_calls=None, usage=None, cost_micros=0,
        iterations=0, approval=None, caps=None, budget=None, version=0, labels=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        run_id: String,
        tenant: String,
        agent_name: String,
        state: RunState,
        session_id: Option<String>,
        messages_read: i128,
        pending_tool_calls: Option<Vec<ToolCall>>,
        usage: Option<Usage>,
        cost_micros: i128,
        iterations: i128,
        approval: Option<Approval>,
        caps: Option<Caps>,
        budget: Option<String>,
        version: i128,
        labels: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut r = a::RunRecord::new(a::RunKey::new(tenant, run_id), agent_name);
        r.state = state.into();
        r.session_id = session_id;
        r.messages_read = amount(py, messages_read, "messages_read")?;
        r.pending_tool_calls = pending_tool_calls
            .unwrap_or_default()
            .into_iter()
            .map(Into::into)
            .collect();
        r.usage = usage.unwrap_or_default().into();
        r.cost_micros = amount(py, cost_micros, "cost_micros")?;
        r.iterations = amount(py, iterations, "iterations")?;
        r.approval = approval.map(|ap| a::Approval {
            id: ap.id,
            prompt: ap.prompt,
        });
        r.caps = caps.unwrap_or_default().into();
        r.budget = budget;
        r.version = amount(py, version, "version")?;
        r.labels = labels_in(py, labels.as_ref())?;
        Ok(RunRecord { inner: r })
    }

    /// The application's labels: a dict of str to JSON values (a copy:
    /// assign a new dict to change them). Scrubbed like tool-call
    /// arguments when stored.
    #[getter]
    fn labels(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        json_out(py, serde_json::to_string(&self.inner.labels))
    }
    #[setter]
    fn set_labels(&mut self, py: Python<'_>, v: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        self.inner.labels = labels_in(py, v.as_ref())?;
        Ok(())
    }

    /// The run's key (tenant and run id).
    #[getter]
    fn key(&self) -> RunKey {
        self.inner.key.clone().into()
    }
    #[getter]
    fn run_id(&self) -> String {
        self.inner.key.run_id.clone()
    }
    #[getter]
    fn tenant(&self) -> String {
        self.inner.key.tenant.clone()
    }
    /// The version this record was read at (0: not stored yet).
    #[getter]
    fn version(&self) -> u64 {
        self.inner.version
    }
    #[setter]
    fn set_version(&mut self, v: u64) {
        self.inner.version = v;
    }
    #[getter]
    fn messages_read(&self) -> u64 {
        self.inner.messages_read
    }
    #[setter]
    fn set_messages_read(&mut self, py: Python<'_>, v: i128) -> PyResult<()> {
        self.inner.messages_read = amount(py, v, "messages_read")?;
        Ok(())
    }
    #[getter]
    fn cost_micros(&self) -> u64 {
        self.inner.cost_micros
    }
    #[setter]
    fn set_cost_micros(&mut self, py: Python<'_>, v: i128) -> PyResult<()> {
        self.inner.cost_micros = amount(py, v, "cost_micros")?;
        Ok(())
    }
    #[getter]
    fn iterations(&self) -> u64 {
        self.inner.iterations
    }
    #[setter]
    fn set_iterations(&mut self, py: Python<'_>, v: i128) -> PyResult<()> {
        self.inner.iterations = amount(py, v, "iterations")?;
        Ok(())
    }
    /// The tool calls asked for and never answered (a copy: assign a new
    /// list to change them).
    #[getter]
    fn pending_tool_calls(&self) -> Vec<ToolCall> {
        self.inner
            .pending_tool_calls
            .iter()
            .cloned()
            .map(Into::into)
            .collect()
    }
    #[setter]
    fn set_pending_tool_calls(&mut self, v: Vec<ToolCall>) {
        self.inner.pending_tool_calls = v.into_iter().map(Into::into).collect();
    }
    #[getter]
    fn approval(&self) -> Option<Approval> {
        self.inner.approval.clone().map(|ap| Approval {
            id: ap.id,
            prompt: ap.prompt,
        })
    }
    #[setter]
    fn set_approval(&mut self, v: Option<Approval>) {
        self.inner.approval = v.map(|ap| a::Approval {
            id: ap.id,
            prompt: ap.prompt,
        });
    }
    /// Set by the store (its clock), in milliseconds.
    #[getter]
    fn created_at(&self) -> u64 {
        self.inner.created_at
    }
    #[getter]
    fn updated_at(&self) -> u64 {
        self.inner.updated_at
    }
    /// The store's insertion counter: what listings order by.
    #[getter]
    fn seq(&self) -> u64 {
        self.inner.seq
    }
    /// True while a tool call was asked for and never came back.
    #[getter]
    fn mid_tool_call(&self) -> bool {
        self.inner.mid_tool_call()
    }
    /// The record with secrets in tool-call arguments redacted: what every
    /// store writes.
    fn scrubbed(&self) -> RunRecord {
        RunRecord {
            inner: self.inner.scrubbed(),
        }
    }
    /// A copy.
    fn copy(&self) -> RunRecord {
        self.clone()
    }
    fn __copy__(&self) -> RunRecord {
        self.clone()
    }
    fn __deepcopy__(&self, _memo: &Bound<'_, PyAny>) -> RunRecord {
        self.clone()
    }
    fn __repr__(&self) -> String {
        let r = &self.inner;
        format!(
            "RunRecord(run_id={:?}, tenant={:?}, agent_name={:?}, version={}, state={}, \
             session_id={}, messages_read={}, pending_tool_calls={}, cost_micros={}, \
             iterations={}, usage=({}, {}), seq={}, labels=<{} keys>)",
            r.key.run_id,
            r.key.tenant,
            r.agent_name,
            r.version,
            r.state,
            opt_repr(&r.session_id),
            r.messages_read,
            r.pending_tool_calls.len(),
            r.cost_micros,
            r.iterations,
            r.usage.input_tokens,
            r.usage.output_tokens,
            r.seq,
            r.labels.len()
        )
    }
}

/// Amounts to add to a run (`patch_run`): they commute.
#[pyclass(frozen, eq, from_py_object, module = "agentstate_rs")]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct StateDelta {
    pub inner: a::StateDelta,
}

#[pymethods]
impl StateDelta {
    #[new]
    #[pyo3(signature = (usage=None, cost_micros=0, iterations=0, messages_read=0))]
    fn new(
        py: Python<'_>,
        usage: Option<Usage>,
        cost_micros: i128,
        iterations: i128,
        messages_read: i128,
    ) -> PyResult<Self> {
        Ok(StateDelta {
            inner: a::StateDelta {
                usage: usage.unwrap_or_default().into(),
                cost_micros: amount(py, cost_micros, "cost_micros")?,
                iterations: amount(py, iterations, "iterations")?,
                messages_read: amount(py, messages_read, "messages_read")?,
            },
        })
    }
    #[getter]
    fn usage(&self) -> Usage {
        self.inner.usage.into()
    }
    #[getter]
    fn cost_micros(&self) -> u64 {
        self.inner.cost_micros
    }
    #[getter]
    fn iterations(&self) -> u64 {
        self.inner.iterations
    }
    #[getter]
    fn messages_read(&self) -> u64 {
        self.inner.messages_read
    }
    fn __repr__(&self) -> String {
        let d = &self.inner;
        format!(
            "StateDelta(usage=Usage(input_tokens={}, output_tokens={}), cost_micros={}, iterations={}, messages_read={})",
            d.usage.input_tokens,
            d.usage.output_tokens,
            d.cost_micros,
            d.iterations,
            d.messages_read
        )
    }
}

/// A listing of a tenant's runs, with filters; `limit` and `cursor` page it.
///
/// The next page passes the tenant and the cursor only: the cursor
/// carries the filters of the walk it continues.
#[pyclass(frozen, from_py_object, module = "agentstate_rs")]
#[derive(Clone)]
pub struct StateQuery {
    pub inner: a::StateQuery,
    #[pyo3(get)]
    pub limit: usize,
    #[pyo3(get)]
    pub cursor: Option<String>,
}

#[pymethods]
impl StateQuery {
    #[new]
    #[pyo3(signature = (tenant, *, state=None, session=None, agent=None, updated_before=None, limit=100, cursor=None, label=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        tenant: String,
        state: Option<RunState>,
        session: Option<String>,
        agent: Option<String>,
        updated_before: Option<u64>,
        limit: usize,
        cursor: Option<String>,
        label: Option<(String, Bound<'_, PyAny>)>,
    ) -> PyResult<Self> {
        let mut q = a::StateQuery::new(tenant);
        q.state = state.map(Into::into);
        q.session = session;
        q.agent = agent;
        q.updated_before = updated_before;
        if let Some((k, v)) = label {
            q = q.label(k, json_in(py, &v, "label")?);
        }
        Ok(StateQuery {
            inner: q,
            limit,
            cursor,
        })
    }
    /// The one exact label the runs must carry: `(key, value)`.
    #[getter]
    fn label(&self, py: Python<'_>) -> PyResult<Option<(String, Py<PyAny>)>> {
        self.inner
            .label
            .as_ref()
            .map(|l| {
                Ok((
                    l.key.clone(),
                    json_out(py, serde_json::to_string(&l.value))?,
                ))
            })
            .transpose()
    }
    #[getter]
    fn tenant(&self) -> String {
        self.inner.tenant.clone()
    }
    #[getter]
    fn state(&self) -> Option<RunState> {
        self.inner.state.map(Into::into)
    }
    #[getter]
    fn session(&self) -> Option<String> {
        self.inner.session.clone()
    }
    #[getter]
    fn agent(&self) -> Option<String> {
        self.inner.agent.clone()
    }
    #[getter]
    fn updated_before(&self) -> Option<u64> {
        self.inner.updated_before
    }
    fn __repr__(&self) -> String {
        let q = &self.inner;
        format!(
            "StateQuery(tenant={:?}, state={}, session={}, agent={}, updated_before={}, label={}, limit={}, cursor={})",
            q.tenant,
            q.state
                .map(|s| s.as_str())
                .map(|s| format!("{s:?}"))
                .unwrap_or("None".into()),
            opt_repr(&q.session),
            opt_repr(&q.agent),
            opt_repr(&q.updated_before),
            match &q.label {
                Some(l) => format!("({:?}, {})", l.key, l.value),
                None => "None".into(),
            },
            self.limit,
            if self.cursor.is_some() {
                "<cursor>"
            } else {
                "None"
            }
        )
    }
}

impl StateQuery {
    pub fn page(&self) -> a::PageRequest {
        page_request(self.limit, self.cursor.clone())
    }
}

pub fn page_request(limit: usize, cursor: Option<String>) -> a::PageRequest {
    a::PageRequest::new(limit).with_cursor(cursor.map(a::Cursor::from_text))
}

/// One page of a listing: `items`, and the `cursor` of the next page
/// (None at the end of the walk).
#[pyclass(frozen, module = "agentstate_rs")]
pub struct Page {
    #[pyo3(get)]
    pub items: Py<PyList>,
    #[pyo3(get)]
    pub cursor: Option<String>,
}

#[pymethods]
impl Page {
    fn __len__(&self, py: Python<'_>) -> usize {
        self.items.bind(py).len()
    }
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.items.bind(py).try_iter()?.into_any())
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Page(items=<{} items>, cursor={})",
            self.items.bind(py).len(),
            if self.cursor.is_some() {
                "<cursor>"
            } else {
                "None"
            }
        )
    }
}

/// A page on its way to Python.
pub struct PageOut<T> {
    pub items: Vec<T>,
    pub cursor: Option<String>,
}

impl<T, U: From<T>> From<a::Page<T>> for PageOut<U> {
    fn from(p: a::Page<T>) -> Self {
        let (items, cursor) = p.into_parts();
        PageOut {
            items: items.into_iter().map(U::from).collect(),
            cursor: cursor.map(|c| c.as_str().to_owned()),
        }
    }
}

impl<'py, T: IntoPyObject<'py>> IntoPyObject<'py> for PageOut<T> {
    type Target = Page;
    type Output = Bound<'py, Page>;
    type Error = PyErr;
    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, Page>> {
        let items = PyList::new(py, self.items)?.unbind();
        Bound::new(
            py,
            Page {
                items,
                cursor: self.cursor,
            },
        )
    }
}

/// A `(TrayKey, Tray)` pair of a tray listing.
pub struct TrayItem(pub TrayKey, pub Tray);
impl From<(a::TrayKey, a::Tray)> for TrayItem {
    fn from((k, t): (a::TrayKey, a::Tray)) -> Self {
        TrayItem(k.into(), t.into())
    }
}
impl<'py> IntoPyObject<'py> for TrayItem {
    type Target = pyo3::types::PyTuple;
    type Output = Bound<'py, pyo3::types::PyTuple>;
    type Error = PyErr;
    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        (self.0, self.1).into_pyobject(py)
    }
}

// --- sessions ----------------------------------------------------------

/// A session: the conversation across runs, versioned like a run.
#[pyclass(eq, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq)]
pub struct SessionRecord {
    pub inner: a::SessionRecord,
}

#[pymethods]
impl SessionRecord {
    #[new]
    #[pyo3(signature = (session_id, tenant, *, metadata=None, version=0, labels=None))]
    fn new(
        py: Python<'_>,
        session_id: String,
        tenant: String,
        metadata: Option<BTreeMap<String, String>>,
        version: u64,
        labels: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut r = a::SessionRecord::new(a::SessionKey::new(tenant, session_id));
        r.metadata = metadata.unwrap_or_default();
        r.version = version;
        r.labels = labels_in(py, labels.as_ref())?;
        Ok(SessionRecord { inner: r })
    }
    /// The application's labels (a copy: assign a new dict to change them).
    #[getter]
    fn labels(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        json_out(py, serde_json::to_string(&self.inner.labels))
    }
    #[setter]
    fn set_labels(&mut self, py: Python<'_>, v: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        self.inner.labels = labels_in(py, v.as_ref())?;
        Ok(())
    }
    #[getter]
    fn key(&self) -> SessionKey {
        self.inner.key.clone().into()
    }
    #[getter]
    fn session_id(&self) -> String {
        self.inner.key.session_id.clone()
    }
    #[getter]
    fn tenant(&self) -> String {
        self.inner.key.tenant.clone()
    }
    #[getter]
    fn version(&self) -> u64 {
        self.inner.version
    }
    #[setter]
    fn set_version(&mut self, v: u64) {
        self.inner.version = v;
    }
    /// A copy: assign a new dict to change it.
    #[getter]
    fn metadata(&self) -> BTreeMap<String, String> {
        self.inner.metadata.clone()
    }
    #[setter]
    fn set_metadata(&mut self, v: BTreeMap<String, String>) {
        self.inner.metadata = v;
    }
    #[getter]
    fn created_at(&self) -> u64 {
        self.inner.created_at
    }
    #[getter]
    fn updated_at(&self) -> u64 {
        self.inner.updated_at
    }
    fn __repr__(&self) -> String {
        format!(
            "SessionRecord(session_id={:?}, tenant={:?}, version={}, metadata=<{} keys>, \
             labels=<{} keys>)",
            self.inner.key.session_id,
            self.inner.key.tenant,
            self.inner.version,
            self.inner.metadata.len(),
            self.inner.labels.len()
        )
    }
}

impl From<a::SessionRecord> for SessionRecord {
    fn from(inner: a::SessionRecord) -> Self {
        SessionRecord { inner }
    }
}
impl From<a::RunRecord> for RunRecord {
    fn from(inner: a::RunRecord) -> Self {
        RunRecord { inner }
    }
}

// --- trays -----------------------------------------------------------

/// A tray: `marked` while work is in flight, `doc` the durable payload.
#[pyclass(frozen, eq, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq, Eq)]
pub struct Tray {
    pub doc: Vec<u8>,
    #[pyo3(get)]
    pub marked: bool,
    #[pyo3(get)]
    pub env: String,
    #[pyo3(get)]
    pub hostname: String,
}

#[pymethods]
impl Tray {
    /// `env` defaults to `"default"`, `hostname` to this machine's name
    /// (`socket.gethostname()`): the store refuses empty ones.
    #[new]
    #[pyo3(signature = (doc, *, marked=false, env="default".to_string(), hostname=None))]
    fn new(
        py: Python<'_>,
        doc: Vec<u8>,
        marked: bool,
        env: String,
        hostname: Option<String>,
    ) -> PyResult<Self> {
        let hostname = match hostname {
            Some(h) => h,
            None => py
                .import("socket")?
                .call_method0("gethostname")?
                .extract()?,
        };
        Ok(Tray {
            doc,
            marked,
            env,
            hostname,
        })
    }
    #[getter(doc)]
    fn doc_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, pyo3::types::PyBytes> {
        pyo3::types::PyBytes::new(py, &self.doc)
    }
    fn __repr__(&self) -> String {
        format!(
            "Tray(doc=<{} bytes>, marked={}, env={:?}, hostname={:?})",
            self.doc.len(),
            if self.marked { "True" } else { "False" },
            self.env,
            self.hostname
        )
    }
}

impl From<a::Tray> for Tray {
    fn from(t: a::Tray) -> Self {
        Tray {
            doc: t.doc,
            marked: t.marked,
            env: t.env,
            hostname: t.hostname,
        }
    }
}
impl From<Tray> for a::Tray {
    fn from(t: Tray) -> Self {
        a::Tray {
            doc: t.doc,
            marked: t.marked,
            env: t.env,
            hostname: t.hostname,
        }
    }
}

/// One write or delete of a batch (`TrayOp.put(...)`, `TrayOp.delete(...)`).
#[pyclass(frozen, from_py_object, module = "agentstate_rs")]
#[derive(Clone)]
pub struct TrayOp {
    pub inner: a::TrayOp,
}

#[pymethods]
impl TrayOp {
    /// Writes `tray` at `(tray_ns, tray_id)`.
    #[staticmethod]
    fn put(tray_ns: String, tray_id: String, tray: Tray) -> Self {
        TrayOp {
            inner: a::TrayOp::Put {
                tray_ns,
                tray_id,
                tray: tray.into(),
            },
        }
    }
    /// Deletes the tray at `(tray_ns, tray_id)`.
    #[staticmethod]
    fn delete(tray_ns: String, tray_id: String) -> Self {
        TrayOp {
            inner: a::TrayOp::Delete { tray_ns, tray_id },
        }
    }
    fn __repr__(&self) -> String {
        match &self.inner {
            a::TrayOp::Put {
                tray_ns, tray_id, ..
            } => format!("TrayOp.put({tray_ns:?}, {tray_id:?}, ...)"),
            a::TrayOp::Delete { tray_ns, tray_id } => {
                format!("TrayOp.delete({tray_ns:?}, {tray_id:?})")
            }
        }
    }
}

/// A marked tray, for the sweeper.
#[pyclass(frozen, get_all, module = "agentstate_rs")]
#[derive(Clone)]
pub struct MarkedTray {
    pub key: TrayKey,
    pub env: String,
    pub hostname: String,
}

#[pymethods]
impl MarkedTray {
    fn __repr__(&self) -> String {
        format!(
            "MarkedTray(key={}, env={:?}, hostname={:?})",
            self.key.__repr__(),
            self.env,
            self.hostname
        )
    }
}

impl From<a::MarkedTray> for MarkedTray {
    fn from(m: a::MarkedTray) -> Self {
        MarkedTray {
            key: m.key.into(),
            env: m.env,
            hostname: m.hostname,
        }
    }
}

/// An instance's alarm.
#[pyclass(frozen, get_all, module = "agentstate_rs")]
#[derive(Clone)]
pub struct Alarm {
    pub instance: InstanceKey,
    pub due_at: u64,
}

#[pymethods]
impl Alarm {
    fn __repr__(&self) -> String {
        format!(
            "Alarm(instance={}, due_at={})",
            self.instance.__repr__(),
            self.due_at
        )
    }
}

impl From<a::Alarm> for Alarm {
    fn from(m: a::Alarm) -> Self {
        Alarm {
            instance: m.instance.into(),
            due_at: m.due_at,
        }
    }
}

// --- spend caps --------------------------------------------------------

/// Amounts spent or held.
#[pyclass(frozen, get_all, eq, module = "agentstate_rs")]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Spend {
    pub cost_micros: u64,
    pub tokens: u64,
    pub iterations: u64,
}

#[pymethods]
impl Spend {
    fn is_zero(&self) -> bool {
        self.cost_micros == 0 && self.tokens == 0 && self.iterations == 0
    }
    fn __repr__(&self) -> String {
        format!(
            "Spend(cost_micros={}, tokens={}, iterations={})",
            self.cost_micros, self.tokens, self.iterations
        )
    }
}

impl From<a::Spend> for Spend {
    fn from(s: a::Spend) -> Self {
        Spend {
            cost_micros: s.cost_micros,
            tokens: s.tokens,
            iterations: s.iterations,
        }
    }
}

/// A named tenant budget: caps shared by the runs that draw from it.
#[pyclass(eq, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq)]
pub struct BudgetRecord {
    pub inner: a::BudgetRecord,
}

#[pymethods]
impl BudgetRecord {
    #[new]
    #[pyo3(signature = (tenant, name, caps, *, version=0))]
    fn new(tenant: String, name: String, caps: Caps, version: u64) -> Self {
        let mut r = a::BudgetRecord::new(a::BudgetKey::new(tenant, name), caps.into());
        r.version = version;
        BudgetRecord { inner: r }
    }
    #[getter]
    fn key(&self) -> BudgetKey {
        self.inner.key.clone().into()
    }
    #[getter]
    fn version(&self) -> u64 {
        self.inner.version
    }
    #[setter]
    fn set_version(&mut self, v: u64) {
        self.inner.version = v;
    }
    #[getter]
    fn caps(&self) -> Caps {
        self.inner.caps.into()
    }
    #[setter]
    fn set_caps(&mut self, c: Caps) {
        self.inner.caps = c.into();
    }
    fn __repr__(&self) -> String {
        format!(
            "BudgetRecord(tenant={:?}, name={:?}, version={}, caps={})",
            self.inner.key.tenant,
            self.inner.key.name,
            self.inner.version,
            Caps::from(self.inner.caps).__repr__()
        )
    }
}

impl From<a::BudgetRecord> for BudgetRecord {
    fn from(inner: a::BudgetRecord) -> Self {
        BudgetRecord { inner }
    }
}

/// A budget with what is spent and held against it.
#[pyclass(frozen, get_all, module = "agentstate_rs")]
#[derive(Clone)]
pub struct BudgetStatus {
    pub record: BudgetRecord,
    pub spent: Spend,
    pub held: Spend,
    pub holds: u64,
}

impl From<a::BudgetStatus> for BudgetStatus {
    fn from(s: a::BudgetStatus) -> Self {
        BudgetStatus {
            record: s.record.into(),
            spent: s.spent.into(),
            held: s.held.into(),
            holds: s.holds,
        }
    }
}

/// What a reserve asks to hold, for `ttl_millis` on the store's clock.
#[pyclass(frozen, get_all, from_py_object, module = "agentstate_rs")]
#[derive(Clone)]
pub struct Hold {
    pub id: String,
    pub ttl_millis: u64,
    pub cost_micros: u64,
    pub tokens: u64,
    pub iterations: u64,
}

#[pymethods]
impl Hold {
    #[new]
    #[pyo3(signature = (id, ttl_millis, *, cost_micros=0, tokens=0, iterations=0))]
    fn new(id: String, ttl_millis: u64, cost_micros: u64, tokens: u64, iterations: u64) -> Self {
        Hold {
            id,
            ttl_millis,
            cost_micros,
            tokens,
            iterations,
        }
    }
    fn __repr__(&self) -> String {
        format!(
            "Hold(id={:?}, ttl_millis={}, cost_micros={}, tokens={}, iterations={})",
            self.id, self.ttl_millis, self.cost_micros, self.tokens, self.iterations
        )
    }
}

impl From<Hold> for a::Hold {
    fn from(h: Hold) -> Self {
        a::Hold::new(h.id, h.ttl_millis)
            .cost_micros(h.cost_micros)
            .tokens(h.tokens)
            .iterations(h.iterations)
    }
}

/// A live hold.
#[pyclass(frozen, get_all, module = "agentstate_rs")]
#[derive(Clone)]
pub struct HoldRecord {
    pub id: String,
    pub amounts: Spend,
    pub created_at: u64,
    pub expires_at: u64,
}

#[pymethods]
impl HoldRecord {
    fn __repr__(&self) -> String {
        format!(
            "HoldRecord(id={:?}, amounts={}, created_at={}, expires_at={})",
            self.id,
            self.amounts.__repr__(),
            self.created_at,
            self.expires_at
        )
    }
}

impl From<a::HoldRecord> for HoldRecord {
    fn from(h: a::HoldRecord) -> Self {
        HoldRecord {
            id: h.id,
            amounts: h.amounts.into(),
            created_at: h.created_at,
            expires_at: h.expires_at,
        }
    }
}

/// What a settle recorded: the run after it, and the spend past the hold.
#[pyclass(frozen, get_all, module = "agentstate_rs")]
#[derive(Clone)]
pub struct Settled {
    pub record: RunRecord,
    pub overshoot: Spend,
}

impl From<a::Settled> for Settled {
    fn from(s: a::Settled) -> Self {
        Settled {
            record: s.record.into(),
            overshoot: s.overshoot.into(),
        }
    }
}

/// A run's caps, spend and live holds.
#[pyclass(frozen, get_all, module = "agentstate_rs")]
#[derive(Clone)]
pub struct RunSpend {
    pub key: RunKey,
    pub caps: Caps,
    pub budget: Option<String>,
    pub spent: Spend,
    pub held: Spend,
    pub holds: Vec<HoldRecord>,
}

impl From<a::RunSpend> for RunSpend {
    fn from(s: a::RunSpend) -> Self {
        RunSpend {
            key: s.key.into(),
            caps: s.caps.into(),
            budget: s.budget,
            spent: s.spent.into(),
            held: s.held.into(),
            holds: s.holds.into_iter().map(Into::into).collect(),
        }
    }
}
