//! The seeds' tray protocol, as the `pinned` framework's `StateStore`
//! calls it: `set_tray`, `delete_tray`, `get_tray`, `list` and
//! `apply_batch` with pinned's arguments, docs as dicts, any int as an
//! epoch. Every store has it, and so has its blocking facade; the crate's
//! own tray calls (`read_tray`, `write_tray`, `list_trays`, `TrayOp`s)
//! stay beside it, and `delete_tray` / `apply_batch` take either shape.
//!
//! Docs cross as JSON text (written by `json.rs`, read by the standard
//! library's decoder), so what one store holds reads the same from Rust,
//! from this package and from pinned. An epoch below
//! the stored one (a negative one always) raises `FenceLostError`, which
//! pinned's `FenceLost` catches; one the seeds' `bigint` cannot hold is
//! `StateInvalidError`.

use std::future::Future;

use agentstate as a;
use agentstate::AsyncStore;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyList, PyString, PyTuple};

use crate::errors;
use crate::rt;
use crate::store::{StateStore, SyncStateStore};
use crate::types::{InstanceKey, TrayKey, TrayOp};

static LOADS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The largest epoch the seeds' `bigint` column holds.
const EPOCH_MAX: u64 = i64::MAX as u64;

/// `doc` as JSON text (see `json.rs`): a dict, as pinned checks it.
fn doc_in(_py: Python<'_>, doc: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    match doc.cast::<PyDict>() {
        Ok(d) => crate::json::encode(d),
        Err(_) => Err(PyValueError::new_err(format!(
            "tray doc must be a dict, got {}",
            doc.repr()?
        ))),
    }
}

/// A stored doc as a fresh Python object (a dict for every doc written
/// through this protocol or by pinned).
fn doc_out<'py>(py: Python<'py>, key: &a::TrayKey, doc: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let loads = LOADS.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py.import("json")?.getattr("loads")?.unbind())
    })?;
    let text = std::str::from_utf8(doc).map_err(|_| not_json(py, key))?;
    loads
        .bind(py)
        .call1((PyString::new(py, text),))
        .map_err(|_| not_json(py, key))
}

fn not_json(py: Python<'_>, key: &a::TrayKey) -> PyErr {
    errors::invalid(
        py,
        format!(
            "tray ({:?}, {:?}, {:?}, {:?}): its doc is not a JSON document (bytes written \
             with write_tray); read it with read_tray",
            key.ns, key.id, key.tray_ns, key.tray_id
        ),
    )
}

/// An epoch as pinned passes it: any int.
enum Epoch {
    /// One the stores take.
    At(u64),
    /// A negative one: below every stored epoch (0 when none is stored).
    Below(Py<PyAny>),
}

fn epoch_of(py: Python<'_>, e: &Bound<'_, PyAny>) -> PyResult<Epoch> {
    if !e.is_instance_of::<pyo3::types::PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "epoch must be an int, got {}",
            e.repr()?
        )));
    }
    if e.lt(0)? {
        return Ok(Epoch::Below(e.clone().unbind()));
    }
    match e.extract::<u64>() {
        Ok(v) if v <= EPOCH_MAX => Ok(Epoch::At(v)),
        _ => Err(errors::invalid(
            py,
            format!(
                "epoch: {} is past the largest epoch, {EPOCH_MAX} (the seeds' bigint)",
                e.repr()?
            ),
        )),
    }
}

fn check_bool(what: &str, v: &Bound<'_, PyAny>) -> PyResult<bool> {
    if v.is_instance_of::<PyBool>() {
        return v.extract();
    }
    Err(PyTypeError::new_err(format!(
        "{what} must be a bool, got {}",
        v.repr()?
    )))
}

/// Runs `f` at the caller's epoch, or answers `FenceLostError` for a
/// negative one (with the stored epoch, read without moving it).
async fn at<T, F, Fut>(s: AsyncStore, inst: a::InstanceKey, epoch: Epoch, f: F) -> PyResult<T>
where
    F: FnOnce(AsyncStore, u64) -> Fut,
    Fut: Future<Output = a::Result<T>>,
{
    match epoch {
        Epoch::At(e) => f(s, e).await.map_err(errors::to_py),
        Epoch::Below(caller) => {
            let stored = s.epoch(&inst).await.map_err(errors::to_py)?;
            Err(Python::attach(|py| {
                errors::fence_lost(
                    py,
                    &format!(
                        "fence lost on instance ({:?}, {:?}): caller epoch {} < stored epoch {stored}",
                        inst.ns, inst.id, caller
                    ),
                    caller.bind(py),
                    stored,
                    &format!("{}/{}", inst.ns, inst.id),
                )
            }))
        }
    }
}

/// What `get_tray` answers: `None`, or `(marked, doc)`.
struct GotTray(Option<(a::TrayKey, a::Tray)>);

impl<'py> IntoPyObject<'py> for GotTray {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;
    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        match self.0 {
            None => Ok(py.None().into_bound(py)),
            Some((key, tray)) => {
                let doc = doc_out(py, &key, &tray.doc)?;
                Ok(PyTuple::new(
                    py,
                    [PyBool::new(py, tray.marked).to_owned().into_any(), doc],
                )?
                .into_any())
            }
        }
    }
}

/// What `list` answers: `[(tray_ns, tray_id, marked, doc)]`.
struct Listed(Vec<(a::TrayKey, a::Tray)>);

impl<'py> IntoPyObject<'py> for Listed {
    type Target = PyList;
    type Output = Bound<'py, PyList>;
    type Error = PyErr;
    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        let out = PyList::empty(py);
        for (key, tray) in &self.0 {
            let doc = doc_out(py, key, &tray.doc)?;
            out.append((key.tray_ns.as_str(), key.tray_id.as_str(), tray.marked, doc))?;
        }
        Ok(out)
    }
}

/// The instance's trays matching the filters: one fenced call, one
/// snapshot (rule T7).
async fn list_instance(
    s: AsyncStore,
    inst: a::InstanceKey,
    epoch: u64,
    filter: a::TrayFilter,
) -> a::Result<Listed> {
    s.instance_trays(&inst, epoch, &filter).await.map(Listed)
}

/// One op of pinned's batch: `("tray", tray_ns, tray_id, marked, doc)`,
/// `marked=None` deleting.
fn batch_op(py: Python<'_>, op: &Bound<'_, PyAny>) -> PyResult<a::TrayOp> {
    let unknown = || -> PyResult<PyErr> {
        Ok(PyValueError::new_err(format!(
            "unknown batch op {}",
            op.repr()?
        )))
    };
    let Ok(items) = op.extract::<Vec<Bound<'_, PyAny>>>() else {
        return Err(unknown()?);
    };
    if items.len() != 5 || !items[0].eq("tray")? || op.is_instance_of::<PyString>() {
        return Err(unknown()?);
    }
    let tray_ns: String = items[1].extract()?;
    let tray_id: String = items[2].extract()?;
    if items[3].is_none() {
        return Ok(a::TrayOp::Delete { tray_ns, tray_id });
    }
    let marked = check_bool("tray marked", &items[3])?;
    let doc = doc_in(py, &items[4])?;
    Ok(a::TrayOp::Put {
        tray_ns,
        tray_id,
        tray: a::Tray {
            marked,
            doc,
            env: String::new(),
            hostname: String::new(),
        },
    })
}

/// A call in either of the two shapes `delete_tray` and `apply_batch`
/// take, or the seeds' calls, made into a future over the store.
enum Call {
    SetTray(a::TrayKey, a::Tray, Epoch),
    DeleteTray(a::TrayKey, Epoch),
    DeleteTrayKeyed(a::TrayKey, u64),
    GetTray(a::TrayKey, Epoch),
    List(a::InstanceKey, Epoch, a::TrayFilter),
    Batch(a::InstanceKey, Vec<a::TrayOp>, Epoch),
    BatchKeyed(a::InstanceKey, u64, Vec<a::TrayOp>),
}

/// What a call answers, before it crosses to Python.
enum Answer {
    Nothing,
    Existed(bool),
    Got(GotTray),
    Listed(Listed),
}

impl<'py> IntoPyObject<'py> for Answer {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;
    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        Ok(match self {
            Answer::Nothing => py.None().into_bound(py),
            Answer::Existed(b) => PyBool::new(py, b).to_owned().into_any(),
            Answer::Got(g) => g.into_pyobject(py)?,
            Answer::Listed(l) => l.into_pyobject(py)?.into_any(),
        })
    }
}

impl Call {
    async fn run(self, s: AsyncStore) -> PyResult<Answer> {
        match self {
            Call::SetTray(key, tray, epoch) => {
                at(s, key.instance(), epoch, |s, e| async move {
                    s.write_tray(&key, e, tray).await.map(|()| Answer::Nothing)
                })
                .await
            }
            Call::DeleteTray(key, epoch) => {
                at(s, key.instance(), epoch, |s, e| async move {
                    s.delete_tray(&key, e).await.map(|_| Answer::Nothing)
                })
                .await
            }
            Call::DeleteTrayKeyed(key, e) => s
                .delete_tray(&key, e)
                .await
                .map(Answer::Existed)
                .map_err(errors::to_py),
            Call::GetTray(key, epoch) => {
                at(s, key.instance(), epoch, |s, e| async move {
                    let got = s.read_tray(&key, e).await?;
                    Ok(Answer::Got(GotTray(got.map(|t| (key, t)))))
                })
                .await
            }
            Call::List(inst, epoch, filter) => {
                at(s, inst.clone(), epoch, |s, e| async move {
                    list_instance(s, inst, e, filter).await.map(Answer::Listed)
                })
                .await
            }
            Call::Batch(inst, ops, epoch) => {
                at(s, inst.clone(), epoch, |s, e| async move {
                    s.apply_batch(&inst, e, ops).await.map(|()| Answer::Nothing)
                })
                .await
            }
            Call::BatchKeyed(inst, e, ops) => s
                .apply_batch(&inst, e, ops)
                .await
                .map(|()| Answer::Nothing)
                .map_err(errors::to_py),
        }
    }
}

/// The store's env and hostname on each tray a call writes.
fn stamped(store: &StateStore, mut call: Call) -> Call {
    let stamp = |t: &mut a::Tray| {
        t.env.clone_from(&store.env);
        t.hostname.clone_from(&store.hostname);
    };
    match &mut call {
        Call::SetTray(_, t, _) => stamp(t),
        Call::Batch(_, ops, _) => {
            for op in ops {
                if let a::TrayOp::Put { tray, .. } = op {
                    stamp(tray);
                }
            }
        }
        _ => {}
    }
    call
}

fn tray_key(ns: String, id: String, tray_ns: String, tray_id: String) -> a::TrayKey {
    a::TrayKey {
        ns,
        id,
        tray_ns,
        tray_id,
    }
}

fn arg<'py>(
    args: &[Bound<'py, PyAny>],
    kwargs: Option<&Bound<'py, PyDict>>,
    i: usize,
    name: &str,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(v) = args.get(i) {
        return Ok(v.clone());
    }
    if let Some(kw) = kwargs
        && let Some(v) = kw.get_item(name)?
    {
        return Ok(v);
    }
    Err(PyTypeError::new_err(format!(
        "missing required argument: '{name}'"
    )))
}

fn no_extra(
    call: &str,
    args: &[Bound<'_, PyAny>],
    kwargs: Option<&Bound<'_, PyDict>>,
    names: &[&str],
) -> PyResult<()> {
    if args.len() > names.len() {
        return Err(PyTypeError::new_err(format!(
            "{call}() takes {} positional arguments but {} were given",
            names.len(),
            args.len()
        )));
    }
    if let Some(kw) = kwargs {
        for (k, _) in kw.iter() {
            let k: String = k.extract()?;
            let at = names.iter().position(|n| *n == k);
            match at {
                None => {
                    return Err(PyTypeError::new_err(format!(
                        "{call}() got an unexpected keyword argument '{k}'"
                    )));
                }
                Some(i) if i < args.len() => {
                    return Err(PyTypeError::new_err(format!(
                        "{call}() got multiple values for argument '{k}'"
                    )));
                }
                Some(_) => {}
            }
        }
    }
    Ok(())
}

/// Whether a call is in the crate's shape: its first argument is a `K`
/// (a `TrayKey`, an `InstanceKey`), or it names that argument.
fn crate_shape<K: pyo3::PyTypeInfo>(
    args: &[Bound<'_, PyAny>],
    kwargs: Option<&Bound<'_, PyDict>>,
    name: &str,
) -> PyResult<bool> {
    if args.first().is_some_and(|a| a.is_instance_of::<K>()) {
        return Ok(true);
    }
    match kwargs {
        Some(k) => k.contains(name),
        None => Ok(false),
    }
}

/// Parses `delete_tray(ns, id, tray_ns, tray_id, epoch)` or the crate's
/// `delete_tray(key: TrayKey, epoch)`.
fn delete_call(
    py: Python<'_>,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<Call> {
    let args: Vec<Bound<'_, PyAny>> = args.iter().collect();
    if crate_shape::<TrayKey>(&args, kwargs, "key")? {
        no_extra("delete_tray", &args, kwargs, &["key", "epoch"])?;
        let key: TrayKey = arg(&args, kwargs, 0, "key")?.extract()?;
        let epoch: u64 = arg(&args, kwargs, 1, "epoch")?.extract()?;
        return Ok(Call::DeleteTrayKeyed(key.into(), epoch));
    }
    let names = ["ns", "id", "tray_ns", "tray_id", "epoch"];
    no_extra("delete_tray", &args, kwargs, &names)?;
    let s = |i: usize| -> PyResult<String> { arg(&args, kwargs, i, names[i])?.extract() };
    let key = tray_key(s(0)?, s(1)?, s(2)?, s(3)?);
    let epoch = epoch_of(py, &arg(&args, kwargs, 4, "epoch")?)?;
    Ok(Call::DeleteTray(key, epoch))
}

/// Parses `apply_batch(ns, id, ops, epoch)` (pinned's tuples) or the
/// crate's `apply_batch(instance: InstanceKey, epoch, ops: [TrayOp])`.
/// Every op is checked before anything is applied.
fn batch_call(
    py: Python<'_>,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<Call> {
    let args: Vec<Bound<'_, PyAny>> = args.iter().collect();
    if crate_shape::<InstanceKey>(&args, kwargs, "instance")? {
        no_extra("apply_batch", &args, kwargs, &["instance", "epoch", "ops"])?;
        let inst: InstanceKey = arg(&args, kwargs, 0, "instance")?.extract()?;
        let epoch: u64 = arg(&args, kwargs, 1, "epoch")?.extract()?;
        let ops: Vec<TrayOp> = arg(&args, kwargs, 2, "ops")?.extract()?;
        return Ok(Call::BatchKeyed(
            inst.into(),
            epoch,
            ops.into_iter().map(|o| o.inner).collect(),
        ));
    }
    let names = ["ns", "id", "ops", "epoch"];
    no_extra("apply_batch", &args, kwargs, &names)?;
    let ns: String = arg(&args, kwargs, 0, "ns")?.extract()?;
    let id: String = arg(&args, kwargs, 1, "id")?.extract()?;
    let ops_in = arg(&args, kwargs, 2, "ops")?;
    let epoch = epoch_of(py, &arg(&args, kwargs, 3, "epoch")?)?;
    let mut ops = Vec::new();
    for op in ops_in.try_iter()? {
        ops.push(batch_op(py, &op?)?);
    }
    Ok(Call::Batch(a::InstanceKey::new(ns, id), ops, epoch))
}

#[allow(clippy::too_many_arguments)]
fn set_call(
    py: Python<'_>,
    ns: String,
    id: String,
    tray_ns: String,
    tray_id: String,
    marked: &Bound<'_, PyAny>,
    doc: &Bound<'_, PyAny>,
    epoch: &Bound<'_, PyAny>,
) -> PyResult<Call> {
    let marked = check_bool("tray marked", marked)?;
    let doc = doc_in(py, doc)?;
    let epoch = epoch_of(py, epoch)?;
    Ok(Call::SetTray(
        tray_key(ns, id, tray_ns, tray_id),
        a::Tray {
            marked,
            doc,
            env: String::new(),
            hostname: String::new(),
        },
        epoch,
    ))
}

fn list_call(
    py: Python<'_>,
    ns: String,
    id: String,
    epoch: &Bound<'_, PyAny>,
    tray_ns: Option<&Bound<'_, PyAny>>,
    marked: Option<&Bound<'_, PyAny>>,
) -> PyResult<Call> {
    let mut filter = a::TrayFilter::default();
    if let Some(t) = tray_ns.filter(|t| !t.is_none()) {
        if !t.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(format!(
                "tray_ns filter must be a str, got {}",
                t.repr()?
            )));
        }
        filter.tray_ns = Some(t.extract()?);
    }
    if let Some(m) = marked.filter(|m| !m.is_none()) {
        filter.marked = Some(check_bool("marked filter", m)?);
    }
    let epoch = epoch_of(py, epoch)?;
    Ok(Call::List(a::InstanceKey::new(ns, id), epoch, filter))
}

/// Whether a call of this store must be deferred: a PostgreSQL or Redis
/// store called outside a running loop (`asyncio.run(store.get_tray(...))`)
/// returns a coroutine that makes the call once a loop awaits it, as every
/// other call of the store does. Only then are the arguments kept
/// ([`Again`]): the calls that answer at once never build them.
fn deferred(slf: &Bound<'_, StateStore>) -> bool {
    !slf.get().in_place && pyo3_async_runtimes::get_running_loop(slf.py()).is_err()
}

/// Runs the call as every call of the store runs: in place on a memory or
/// file store, else as an awaitable on the package's runtime, or (with
/// `again`, see [`deferred`]) as a coroutine that makes it later.
fn start<'py>(
    slf: &Bound<'py, StateStore>,
    name: &str,
    call: Call,
    again: Option<Again<'py>>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = slf.py();
    if let Some(again) = again {
        return py
            .import("agentstate_rs._defer")?
            .getattr("defer_call")?
            .call1((slf, name, again.0, again.1));
    }
    let me = slf.get();
    let call = stamped(me, call);
    let s = me.handle(py)?;
    if me.in_place {
        return rt::in_place(py, call.run(s.in_caller()));
    }
    rt::future_into_py(py, call.run(s))
}

/// The arguments of a call, to make it again later (see [`start`]).
struct Again<'py>(Bound<'py, PyTuple>, Bound<'py, PyDict>);

impl<'py> Again<'py> {
    fn new(
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Self> {
        let kw = match kwargs {
            Some(k) => k.copy()?,
            None => PyDict::new(py),
        };
        Ok(Again(args.clone(), kw))
    }
}

fn blocking(py: Python<'_>, store: &StateStore, call: Call) -> PyResult<Answer> {
    let call = stamped(store, call);
    let mut s = store.handle(py)?;
    if store.in_place {
        s = s.in_caller();
    }
    py.detach(move || rt::block_on(call.run(s)))
}

fn positional<'py>(
    py: Python<'py>,
    items: Vec<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, items)
}

#[pymethods]
impl StateStore {
    /// Writes the whole tray row `(ns, id, tray_ns, tray_id)` with `marked`
    /// and `doc` (a dict) at the caller's epoch (the seeds' `set_tray`).
    #[pyo3(signature = (ns, id, tray_ns, tray_id, marked, doc, epoch))]
    #[allow(clippy::too_many_arguments)]
    fn set_tray<'py>(
        slf: &Bound<'py, Self>,
        ns: String,
        id: String,
        tray_ns: String,
        tray_id: String,
        marked: &Bound<'py, PyAny>,
        doc: &Bound<'py, PyAny>,
        epoch: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let again = if deferred(slf) {
            let args = positional(
                py,
                vec![
                    PyString::new(py, &ns).into_any(),
                    PyString::new(py, &id).into_any(),
                    PyString::new(py, &tray_ns).into_any(),
                    PyString::new(py, &tray_id).into_any(),
                    marked.clone(),
                    doc.clone(),
                    epoch.clone(),
                ],
            )?;
            Some(Again::new(py, &args, None)?)
        } else {
            None
        };
        let call = set_call(py, ns, id, tray_ns, tray_id, marked, doc, epoch)?;
        start(slf, "set_tray", call, again)
    }

    /// The tray row as `(marked, doc)`, or None, read at the caller's
    /// epoch (the seeds' `get_tray`; the read moves the epoch up as every
    /// tray call does).
    #[pyo3(signature = (ns, id, tray_ns, tray_id, epoch))]
    fn get_tray<'py>(
        slf: &Bound<'py, Self>,
        ns: String,
        id: String,
        tray_ns: String,
        tray_id: String,
        epoch: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let again = if deferred(slf) {
            let args = (
                ns.as_str(),
                id.as_str(),
                tray_ns.as_str(),
                tray_id.as_str(),
                epoch,
            )
                .into_pyobject(py)?;
            Some(Again::new(py, &args, None)?)
        } else {
            None
        };
        let call = Call::GetTray(tray_key(ns, id, tray_ns, tray_id), epoch_of(py, epoch)?);
        start(slf, "get_tray", call, again)
    }

    /// The instance's tray rows as `[(tray_ns, tray_id, marked, doc)]` in
    /// `(tray_ns, tray_id)` order, from one fenced call and one snapshot;
    /// the `tray_ns` and `marked` filters AND together (the seeds' `list`).
    #[pyo3(signature = (ns, id, epoch, *, tray_ns=None, marked=None))]
    fn list<'py>(
        slf: &Bound<'py, Self>,
        ns: String,
        id: String,
        epoch: &Bound<'py, PyAny>,
        tray_ns: Option<&Bound<'py, PyAny>>,
        marked: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let again = if deferred(slf) {
            let kw = PyDict::new(py);
            kw.set_item("tray_ns", tray_ns)?;
            kw.set_item("marked", marked)?;
            Some(Again(
                (ns.as_str(), id.as_str(), epoch).into_pyobject(py)?,
                kw,
            ))
        } else {
            None
        };
        let call = list_call(py, ns, id, epoch, tray_ns, marked)?;
        start(slf, "list", call, again)
    }

    /// Deletes one tray row: `delete_tray(ns, id, tray_ns, tray_id,
    /// epoch)` (the seeds' shape; answers None) or `delete_tray(key,
    /// epoch)` with a `TrayKey` (answers whether it existed).
    #[pyo3(signature = (*args, **kwargs))]
    fn delete_tray<'py>(
        slf: &Bound<'py, Self>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let call = delete_call(py, args, kwargs)?;
        let again = if deferred(slf) {
            Some(Again::new(py, args, kwargs)?)
        } else {
            None
        };
        start(slf, "delete_tray", call, again)
    }

    /// Applies many tray writes and deletes of one instance at one fence,
    /// all or nothing: `apply_batch(ns, id, ops, epoch)` with the seeds'
    /// `("tray", tray_ns, tray_id, marked, doc)` ops (`marked=None`
    /// deletes; an unknown op raises ValueError before anything is
    /// applied), or `apply_batch(instance, epoch, ops)` with `TrayOp`s.
    #[pyo3(signature = (*args, **kwargs))]
    fn apply_batch<'py>(
        slf: &Bound<'py, Self>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let call = batch_call(py, args, kwargs)?;
        let again = if deferred(slf) {
            Some(Again::new(py, args, kwargs)?)
        } else {
            None
        };
        start(slf, "apply_batch", call, again)
    }
}

#[pymethods]
impl SyncStateStore {
    /// `StateStore.set_tray`, answered in place.
    #[pyo3(signature = (ns, id, tray_ns, tray_id, marked, doc, epoch))]
    #[allow(clippy::too_many_arguments)]
    fn set_tray(
        &self,
        py: Python<'_>,
        ns: String,
        id: String,
        tray_ns: String,
        tray_id: String,
        marked: &Bound<'_, PyAny>,
        doc: &Bound<'_, PyAny>,
        epoch: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let call = set_call(py, ns, id, tray_ns, tray_id, marked, doc, epoch)?;
        blocking(py, self.0.get(), call).map(|_| ())
    }

    /// `StateStore.get_tray`, answered in place.
    #[pyo3(signature = (ns, id, tray_ns, tray_id, epoch))]
    fn get_tray<'py>(
        &self,
        py: Python<'py>,
        ns: String,
        id: String,
        tray_ns: String,
        tray_id: String,
        epoch: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let call = Call::GetTray(tray_key(ns, id, tray_ns, tray_id), epoch_of(py, epoch)?);
        blocking(py, self.0.get(), call)?.into_pyobject(py)
    }

    /// `StateStore.list`, answered in place.
    #[pyo3(signature = (ns, id, epoch, *, tray_ns=None, marked=None))]
    fn list<'py>(
        &self,
        py: Python<'py>,
        ns: String,
        id: String,
        epoch: &Bound<'py, PyAny>,
        tray_ns: Option<&Bound<'py, PyAny>>,
        marked: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let call = list_call(py, ns, id, epoch, tray_ns, marked)?;
        blocking(py, self.0.get(), call)?.into_pyobject(py)
    }

    /// `StateStore.delete_tray` (either shape), answered in place.
    #[pyo3(signature = (*args, **kwargs))]
    fn delete_tray<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let call = delete_call(py, args, kwargs)?;
        blocking(py, self.0.get(), call)?.into_pyobject(py)
    }

    /// `StateStore.apply_batch` (either shape), answered in place.
    #[pyo3(signature = (*args, **kwargs))]
    fn apply_batch<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<()> {
        let call = batch_call(py, args, kwargs)?;
        blocking(py, self.0.get(), call).map(|_| ())
    }
}
