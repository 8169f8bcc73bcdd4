//! Injectable clocks: the crate's `ManualClock`, or any Python callable
//! returning milliseconds.

use std::sync::Arc;

use agentstate::Clock;
use pyo3::prelude::*;

/// A clock that moves only when told (`agentstate::ManualClock`).
#[pyclass(frozen, module = "agentstate_rs")]
pub struct ManualClock {
    pub inner: Arc<agentstate::ManualClock>,
}

#[pymethods]
impl ManualClock {
    #[new]
    #[pyo3(signature = (start=0))]
    fn new(start: u64) -> Self {
        ManualClock {
            inner: Arc::new(agentstate::ManualClock::new(start)),
        }
    }
    /// Milliseconds since the epoch, as the clock reads now.
    fn now_millis(&self) -> u64 {
        self.inner.now_millis()
    }
    /// Sets the time.
    fn set(&self, t: u64) {
        self.inner.set(t)
    }
    /// Moves the time forward.
    fn advance(&self, by: u64) {
        self.inner.advance(by)
    }
    fn __call__(&self) -> u64 {
        self.inner.now_millis()
    }
    fn __repr__(&self) -> String {
        format!("ManualClock({})", self.inner.now_millis())
    }
}

/// A Python callable as the store's clock. It is called with the GIL
/// taken; one that raises or returns something else than a non-negative
/// int reads as 0 (and the error is printed by Python's hook).
struct CallableClock(Py<PyAny>);

impl Clock for CallableClock {
    fn now_millis(&self) -> u64 {
        Python::attach(
            |py| match self.0.call0(py).and_then(|v| v.extract::<u64>(py)) {
                Ok(v) => v,
                Err(e) => {
                    e.write_unraisable(py, Some(self.0.bind(py)));
                    0
                }
            },
        )
    }
}

/// The clock a store is given: None (the system's), a `ManualClock`, or a
/// callable.
pub fn clock_of(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Arc<dyn Clock>>> {
    let Some(obj) = obj else { return Ok(None) };
    if obj.is_none() {
        return Ok(None);
    }
    if let Ok(m) = obj.cast::<ManualClock>() {
        return Ok(Some(m.get().inner.clone()));
    }
    if obj.is_callable() {
        return Ok(Some(Arc::new(CallableClock(obj.clone().unbind()))));
    }
    Err(crate::errors::invalid(
        obj.py(),
        "clock: expected a ManualClock or a callable returning milliseconds",
    ))
}
