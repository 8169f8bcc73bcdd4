//! Labels: the application's own fields on runs and sessions (rule R11).
//!
//! A small map of string keys to JSON values (a user id, a thread title,
//! a model, a trace id), stored with the record in the same write, so an
//! application needs no second table beside the store. Labels are checked
//! against named limits on every write ([`LABELS_MAX`](crate::limits::LABELS_MAX),
//! [`LABEL_KEY_BYTES_MAX`](crate::limits::LABEL_KEY_BYTES_MAX),
//! [`LABEL_VALUE_BYTES_MAX`](crate::limits::LABEL_VALUE_BYTES_MAX)), scrubbed of
//! secrets like tool-call arguments, and a listing filters on one exact
//! label through an index ([`StateQuery::label`](crate::StateQuery::label)).
//!
//! Two values are the same label value when their JSON is equal: object
//! keys in any order, numbers as JSON numbers (`1` and `1.0` differ, as
//! they do in JSON text). The store compares values by their canonical
//! text: compact JSON with object keys sorted.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::ops::{Deref, DerefMut};

use serde::de::{self, MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::error::{Result, StateError};

use crate::limits::{LABEL_KEY_BYTES_MAX, LABEL_VALUE_BYTES_MAX, LABELS_MAX};

/// The labels of a run or a session: keys to JSON values, in key order.
///
/// Dereferences to the map, so `labels.get("user")`, `labels.len()` and
/// iteration work as on a `BTreeMap`; [`Labels::with`] builds them.
///
/// In JSON (human-readable formats) labels are an object of their values;
/// in the store's binary encoding each value is its canonical JSON text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Labels(BTreeMap<String, Value>);

// JSON values from serde_json never hold a NaN (JSON has none), so their
// equality is an equivalence.
impl Eq for Labels {}

impl Labels {
    /// No labels.
    pub fn new() -> Self {
        Labels::default()
    }

    /// These labels and `key` set to `value`.
    #[must_use]
    pub fn with(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.0.insert(key.into(), value.into());
        self
    }

    /// The map underneath.
    pub fn into_inner(self) -> BTreeMap<String, Value> {
        self.0
    }
}

impl Deref for Labels {
    type Target = BTreeMap<String, Value>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl DerefMut for Labels {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl From<BTreeMap<String, Value>> for Labels {
    fn from(m: BTreeMap<String, Value>) -> Self {
        Labels(m)
    }
}

impl<K: Into<String>, V: Into<Value>> FromIterator<(K, V)> for Labels {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Labels(
            iter.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }
}

impl<'a> IntoIterator for &'a Labels {
    type Item = (&'a String, &'a Value);
    type IntoIter = std::collections::btree_map::Iter<'a, String, Value>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl Serialize for Labels {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            return self.0.serialize(s);
        }
        // Binary formats (postcard) cannot carry a self-describing JSON
        // value: each value travels as its canonical text.
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, &canonical(v))?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for Labels {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        if d.is_human_readable() {
            return BTreeMap::<String, Value>::deserialize(d).map(Labels);
        }
        struct Texts;
        impl<'de> Visitor<'de> for Texts {
            type Value = Labels;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map of label keys to JSON texts")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Labels, A::Error> {
                let mut out = BTreeMap::new();
                while let Some((k, text)) = m.next_entry::<String, String>()? {
                    let v = serde_json::from_str(&text).map_err(de::Error::custom)?;
                    out.insert(k, v);
                }
                Ok(Labels(out))
            }
        }
        d.deserialize_map(Texts)
    }
}

/// One exact label a listing filters on: runs whose label `key` holds a
/// value equal to `value`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Label {
    /// The label's key.
    pub key: String,
    /// The value it must hold.
    pub value: Value,
}

// As for `Labels`: no NaN in a JSON value.
impl Eq for Label {}

impl Label {
    /// The filter `key` = `value`.
    pub fn new(key: impl Into<String>, value: impl Into<Value>) -> Self {
        Label {
            key: key.into(),
            value: value.into(),
        }
    }
}

/// A value's canonical JSON text: compact, object keys sorted (by their
/// UTF-8 bytes), so two equal values have one text whatever order their
/// objects were built in. The store indexes and compares label values by
/// this text.
pub fn canonical(v: &Value) -> String {
    let mut out = String::new();
    write_canonical(&mut out, v);
    out
}

fn write_canonical(out: &mut String, v: &Value) {
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(out, item);
            }
            out.push(']');
        }
        Value::Object(m) => {
            let mut entries: Vec<(&String, &Value)> = m.iter().collect();
            entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                // A string's JSON text never fails to serialize.
                let _ = write!(out, "{}", Value::String(k.clone()));
                out.push(':');
                write_canonical(out, item);
            }
            out.push('}');
        }
        // Scalars: serde_json's compact text is already canonical.
        other => {
            let _ = write!(out, "{other}");
        }
    }
}

/// True when a JSON value holds a NUL in any string or object key: no
/// backend can store it as text (PostgreSQL's `jsonb` refuses `\u0000`).
fn holds_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(holds_nul),
        Value::Object(m) => m.iter().any(|(k, v)| k.contains('\0') || holds_nul(v)),
        _ => false,
    }
}

/// A label key: 1..=[`LABEL_KEY_BYTES_MAX`] bytes, no NUL.
fn check_key(key: &str) -> Result<()> {
    if key.is_empty() || key.len() > LABEL_KEY_BYTES_MAX {
        return Err(StateError::invalid(format!(
            "label key: must be 1..={LABEL_KEY_BYTES_MAX} bytes, got {}",
            key.len()
        )));
    }
    if key.contains('\0') {
        return Err(StateError::invalid("label key: holds a NUL"));
    }
    Ok(())
}

/// A label value: at most [`LABEL_VALUE_BYTES_MAX`] bytes of canonical
/// JSON, no NUL in any string.
fn check_value(key: &str, v: &Value) -> Result<String> {
    let text = canonical(v);
    if text.len() > LABEL_VALUE_BYTES_MAX {
        return Err(StateError::invalid(format!(
            "label {key:?}: value is {} bytes of JSON, the limit is {LABEL_VALUE_BYTES_MAX}",
            text.len()
        )));
    }
    if holds_nul(v) {
        return Err(StateError::invalid(format!(
            "label {key:?}: value holds a NUL"
        )));
    }
    Ok(text)
}

/// The labels of a record, against the limits (R11).
pub fn check_labels(labels: &Labels) -> Result<()> {
    if labels.len() > LABELS_MAX {
        return Err(StateError::invalid(format!(
            "labels: at most {LABELS_MAX}, got {}",
            labels.len()
        )));
    }
    for (k, v) in labels.iter() {
        check_key(k)?;
        check_value(k, v)?;
    }
    Ok(())
}

/// A listing's label filter, against the same limits; its value's
/// canonical text.
pub fn check_label(l: &Label) -> Result<String> {
    check_key(&l.key)?;
    check_value(&l.key, &l.value)
}

/// `labels` with secrets scrubbed as tool-call arguments are: the labels
/// as one JSON object through the scrubber, so key rules (`"api_key"`)
/// and secret shapes in values both apply. `None` when nothing changed.
#[allow(clippy::expect_used, reason = "JSON values always serialize")]
pub fn scrubbed(scrubber: &crate::Scrubber, labels: &Labels) -> Option<Labels> {
    if labels.is_empty() {
        return None;
    }
    let text = serde_json::to_string(&labels.0).expect("JSON values always serialize");
    let clean = scrubber.scrub_arguments(&text);
    if clean == text {
        return None;
    }
    // The scrubber keeps JSON valid JSON; were it ever not, every value is
    // withheld rather than stored unscrubbed.
    Some(
        match serde_json::from_str::<BTreeMap<String, Value>>(&clean) {
            Ok(m) => Labels(m),
            Err(_) => Labels(
                labels
                    .keys()
                    .map(|k| (k.clone(), Value::String(crate::REDACTED.to_owned())))
                    .collect(),
            ),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_sorts_object_keys_at_every_depth() {
        let a = json!({"b": [1, {"y": 2, "x": 1}], "a": "s"});
        assert_eq!(canonical(&a), r#"{"a":"s","b":[1,{"x":1,"y":2}]}"#);
        assert_eq!(canonical(&json!("é\n")), r#""é\n""#);
        assert_eq!(canonical(&json!(1.5)), "1.5");
    }

    #[test]
    fn binary_and_json_forms_round_trip() {
        let l = Labels::new()
            .with("user", "u-1")
            .with("n", 3)
            .with("o", json!({"k": [true, null]}));
        let bin = postcard::to_stdvec(&l).unwrap();
        assert_eq!(postcard::from_bytes::<Labels>(&bin).unwrap(), l);
        let text = serde_json::to_string(&l).unwrap();
        assert_eq!(text, r#"{"n":3,"o":{"k":[true,null]},"user":"u-1"}"#);
        assert_eq!(serde_json::from_str::<Labels>(&text).unwrap(), l);
    }

    #[test]
    fn limits_and_nul_are_refused() {
        let many: Labels = (0..=LABELS_MAX).map(|i| (format!("k{i}"), i)).collect();
        assert!(check_labels(&many).is_err());
        assert!(check_labels(&Labels::new().with("", 1)).is_err());
        assert!(check_labels(&Labels::new().with("k".repeat(129), 1)).is_err());
        assert!(check_labels(&Labels::new().with("k", "v".repeat(1100))).is_err());
        assert!(check_labels(&Labels::new().with("k", json!({"a\0": 1}))).is_err());
        assert!(check_labels(&Labels::new().with("k", "a\0")).is_err());
        let ok: Labels = (0..LABELS_MAX).map(|i| (format!("k{i}"), i)).collect();
        check_labels(&ok).unwrap();
    }

    #[test]
    fn scrubbing_redacts_secret_keys_and_shapes() {
        let s = crate::Scrubber::default();
        let l = Labels::new()
            .with("api_key", "hunter2hunter2")
            .with("note", "token sk-abcdefghijklmnopqrstuvwxyz0123")
            .with("user", "u-1");
        let clean = scrubbed(&s, &l).expect("something to scrub");
        assert_eq!(clean.get("user"), Some(&json!("u-1")));
        assert_ne!(clean.get("api_key"), l.get("api_key"));
        assert!(!clean["note"].as_str().unwrap().contains("sk-abcdef"));
        assert!(scrubbed(&s, &clean).is_none(), "idempotent");
        assert!(scrubbed(&s, &Labels::new().with("user", "u-1")).is_none());
    }
}
