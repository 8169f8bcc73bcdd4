//! A tray doc (a dict) as JSON text, written here rather than by the
//! standard library's encoder for one reason: numbers must read back as
//! the same Python values from every store, PostgreSQL's `jsonb` included.
//! `jsonb` keeps a number as a decimal and prints it without an exponent
//! (`1e+16` comes back as `10000000000000000`, which Python reads as an
//! int). So a float is written as its shortest round-trip decimal, never
//! with an exponent and always with a point (`10000000000000000.0`),
//! which `jsonb` prints back unchanged; ints as their digits. Everything
//! else is `json.dumps(doc, ensure_ascii=False, allow_nan=False)`'s JSON:
//! strings as UTF-8 with `"`, `\` and control characters escaped, tuples
//! and lists as arrays, `str`/`int`/`float`/`bool`/`None` keys as
//! `json.dumps` turns them into strings, anything else a `TypeError`, NaN
//! and infinities a `ValueError`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

/// Nesting past this is refused (as a circular reference would be).
const DEPTH_MAX: usize = 512;

/// `doc` as JSON text.
pub fn encode(doc: &Bound<'_, PyDict>) -> PyResult<Vec<u8>> {
    let mut out = Vec::with_capacity(256);
    value(doc.as_any(), &mut out, 0)?;
    Ok(out)
}

fn value(v: &Bound<'_, PyAny>, out: &mut Vec<u8>, depth: usize) -> PyResult<()> {
    if depth > DEPTH_MAX {
        return Err(PyValueError::new_err(
            "tray doc nests deeper than 512 levels (or refers to itself)",
        ));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return string(s, out);
    }
    if v.is_none() {
        out.extend_from_slice(b"null");
        return Ok(());
    }
    if let Ok(b) = v.cast::<PyBool>() {
        out.extend_from_slice(if b.is_true() { b"true" } else { b"false" });
        return Ok(());
    }
    if v.is_instance_of::<PyInt>() {
        return int(v, out);
    }
    if let Ok(f) = v.cast::<PyFloat>() {
        return float(f.value(), out);
    }
    if let Ok(d) = v.cast::<PyDict>() {
        out.push(b'{');
        for (i, (k, item)) in d.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            key(&k, out)?;
            out.push(b':');
            value(&item, out, depth + 1)?;
        }
        out.push(b'}');
        return Ok(());
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        out.push(b'[');
        for (i, item) in v.try_iter()?.enumerate() {
            if i > 0 {
                out.push(b',');
            }
            value(&item?, out, depth + 1)?;
        }
        out.push(b']');
        return Ok(());
    }
    Err(PyTypeError::new_err(format!(
        "Object of type {} is not JSON serializable",
        v.get_type().name()?
    )))
}

/// A dict key, as `json.dumps` makes it a string.
#[allow(
    clippy::expect_used,
    reason = "a float's text is ASCII; digits are ASCII"
)]
fn key(k: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> PyResult<()> {
    if let Ok(s) = k.cast::<PyString>() {
        return string(s, out);
    }
    let text = if k.is_none() {
        "null".to_string()
    } else if let Ok(b) = k.cast::<PyBool>() {
        if b.is_true() { "true" } else { "false" }.to_string()
    } else if k.is_instance_of::<PyInt>() {
        let mut digits = Vec::new();
        int(k, &mut digits)?;
        String::from_utf8(digits).expect("digits are ASCII")
    } else if let Ok(f) = k.cast::<PyFloat>() {
        let mut digits = Vec::new();
        float(f.value(), &mut digits)?;
        String::from_utf8(digits).expect("a float's text is ASCII")
    } else {
        return Err(PyTypeError::new_err(format!(
            "keys must be str, int, float, bool or None, not {}",
            k.get_type().name()?
        )));
    };
    quoted(&text, out);
    Ok(())
}

fn int(v: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> PyResult<()> {
    match v.extract::<i64>() {
        Ok(n) => out.extend_from_slice(n.to_string().as_bytes()),
        // Past 64 bits: Python's own digits (an int subclass's __repr__
        // is not asked, as json.dumps does not ask it).
        Err(_) => {
            let text = v.py().get_type::<PyInt>().call_method1("__repr__", (v,))?;
            out.extend_from_slice(text.cast::<PyString>()?.to_cow()?.as_bytes());
        }
    }
    Ok(())
}

fn float(f: f64, out: &mut Vec<u8>) -> PyResult<()> {
    if !f.is_finite() {
        return Err(PyValueError::new_err(format!(
            "Out of range float values are not JSON compliant: {f}"
        )));
    }
    // Rust's Display is the shortest text that reads back as the same
    // f64, in plain decimal (no exponent).
    let text = format!("{f}");
    out.extend_from_slice(text.as_bytes());
    if !text.contains('.') {
        out.extend_from_slice(b".0");
    }
    Ok(())
}

fn string(s: &Bound<'_, PyString>, out: &mut Vec<u8>) -> PyResult<()> {
    let text = s.to_cow().map_err(|_| {
        PyValueError::new_err(
            "tray doc holds a string that is not valid Unicode (a lone surrogate)",
        )
    })?;
    quoted(&text, out);
    Ok(())
}

fn quoted(text: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for &b in text.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            0..=0x1f => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[(b >> 4) as usize]);
                out.push(HEX[(b & 0xf) as usize]);
            }
            _ => out.push(b),
        }
    }
    out.push(b'"');
}
