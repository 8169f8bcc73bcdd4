//! Trays of pinned workers, epochs and alarms (rules T1–T6, A1–A3).

use serde::{Deserialize, Serialize};

use crate::record::Millis;

/// One pinned-worker instance `(ns, id)`; the unit of fencing.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct InstanceKey {
    /// The instance's namespace.
    pub ns: String,
    /// The instance's id within `ns`.
    pub id: String,
}

impl InstanceKey {
    /// A key from its two parts.
    pub fn new(ns: impl Into<String>, id: impl Into<String>) -> Self {
        InstanceKey {
            ns: ns.into(),
            id: id.into(),
        }
    }
    /// The key of one of this instance's trays.
    pub fn tray(&self, tray_ns: impl Into<String>, tray_id: impl Into<String>) -> TrayKey {
        TrayKey {
            ns: self.ns.clone(),
            id: self.id.clone(),
            tray_ns: tray_ns.into(),
            tray_id: tray_id.into(),
        }
    }
}

/// One durable row of an instance (rule T1).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TrayKey {
    /// The instance's namespace.
    pub ns: String,
    /// The instance's id.
    pub id: String,
    /// The tray's namespace within the instance.
    pub tray_ns: String,
    /// The tray's id.
    pub tray_id: String,
}

impl TrayKey {
    /// The instance this tray belongs to.
    pub fn instance(&self) -> InstanceKey {
        InstanceKey::new(self.ns.clone(), self.id.clone())
    }
}

/// A tray's contents.
///
/// In JSON (and every human-readable format) `doc` is text when it is
/// UTF-8 (`"doc": "{\"step\": 3}"`) and base64 otherwise
/// (`"doc_base64": "AAEC"`); either reads back, as does the array of
/// numbers earlier releases wrote. Binary formats keep the bytes as they
/// are (the stores' own encoding is unchanged).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tray {
    /// True while work is in flight; the sweeper wakes marked trays.
    pub marked: bool,
    /// The whole durable payload.
    pub doc: Vec<u8>,
    /// The env of the worker that wrote it.
    pub env: String,
    /// The host of the worker that wrote it.
    pub hostname: String,
}

/// The field layout every binary format has always had.
#[derive(Serialize, Deserialize)]
#[serde(rename = "Tray")]
struct TrayBytes {
    marked: bool,
    doc: Vec<u8>,
    env: String,
    hostname: String,
}

#[derive(Serialize)]
#[serde(rename = "Tray")]
struct TrayText<'a> {
    marked: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    doc: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    doc_base64: Option<String>,
    env: &'a str,
    hostname: &'a str,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum DocIn {
    Text(String),
    Bytes(Vec<u8>),
}

#[derive(Deserialize)]
#[serde(rename = "Tray", deny_unknown_fields)]
struct TrayTextIn {
    marked: bool,
    #[serde(default)]
    doc: Option<DocIn>,
    #[serde(default)]
    doc_base64: Option<String>,
    env: String,
    hostname: String,
}

impl Serialize for Tray {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if !s.is_human_readable() {
            return TrayBytes {
                marked: self.marked,
                doc: self.doc.clone(),
                env: self.env.clone(),
                hostname: self.hostname.clone(),
            }
            .serialize(s);
        }
        use base64::Engine as _;
        let text = std::str::from_utf8(&self.doc).ok();
        TrayText {
            marked: self.marked,
            doc: text,
            doc_base64: text
                .is_none()
                .then(|| base64::engine::general_purpose::STANDARD.encode(&self.doc)),
            env: &self.env,
            hostname: &self.hostname,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Tray {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        if !d.is_human_readable() {
            let t = TrayBytes::deserialize(d)?;
            return Ok(Tray {
                marked: t.marked,
                doc: t.doc,
                env: t.env,
                hostname: t.hostname,
            });
        }
        let t = TrayTextIn::deserialize(d)?;
        let doc = match (t.doc, t.doc_base64) {
            (Some(DocIn::Text(text)), None) => text.into_bytes(),
            (Some(DocIn::Bytes(bytes)), None) => bytes,
            (None, Some(b64)) => {
                use base64::Engine as _;
                base64::engine::general_purpose::STANDARD
                    .decode(b64.as_bytes())
                    .map_err(|e| D::Error::custom(format!("doc_base64: {e}")))?
            }
            (None, None) => return Err(D::Error::missing_field("doc")),
            (Some(_), Some(_)) => {
                return Err(D::Error::custom("a tray has doc or doc_base64, not both"));
            }
        };
        Ok(Tray {
            marked: t.marked,
            doc,
            env: t.env,
            hostname: t.hostname,
        })
    }
}

/// One operation of a tray batch (rule T3).
///
/// Exhaustive on purpose: every backend must apply every operation, so a
/// new one is a compile error in a backend that does not know it rather
/// than a refusal at run time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TrayOp {
    /// Write a tray of the batch's instance.
    Put {
        /// The tray's namespace.
        tray_ns: String,
        /// The tray's id.
        tray_id: String,
        /// Its new contents.
        tray: Tray,
    },
    /// Delete a tray of the batch's instance (absent is fine).
    Delete {
        /// The tray's namespace.
        tray_ns: String,
        /// The tray's id.
        tray_id: String,
    },
}

/// Which of an instance's trays [`TrayStore::instance_trays`] answers
/// (rule T7): the filters are AND-ed, and `TrayFilter::default()` (or
/// [`TrayFilter::new`]) is no filter, every tray of the instance.
///
/// ```
/// use agentstate::TrayFilter;
///
/// let f = TrayFilter::new().tray_ns("inbox").marked(true);
/// assert_eq!(f.tray_ns.as_deref(), Some("inbox"));
/// assert_eq!(f.marked, Some(true));
/// assert_eq!(TrayFilter::new(), TrayFilter::default());
/// ```
///
/// [`TrayStore::instance_trays`]: crate::TrayStore::instance_trays
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TrayFilter {
    /// Only the trays of this tray namespace (an id: rule K1).
    pub tray_ns: Option<String>,
    /// Only the marked trays (`Some(true)`) or only the unmarked ones
    /// (`Some(false)`).
    pub marked: Option<bool>,
}

impl TrayFilter {
    /// No filter: every tray of the instance.
    pub fn new() -> Self {
        TrayFilter::default()
    }
    /// Only the trays of `tray_ns`.
    pub fn tray_ns(mut self, tray_ns: impl Into<String>) -> Self {
        self.tray_ns = Some(tray_ns.into());
        self
    }
    /// Only the marked trays (`true`) or only the unmarked ones (`false`).
    pub fn marked(mut self, marked: bool) -> Self {
        self.marked = Some(marked);
        self
    }
    /// Whether the tray `key` holding `tray` passes every filter (a
    /// backend that filters in the client uses it).
    pub fn matches(&self, key: &TrayKey, tray: &Tray) -> bool {
        self.tray_ns.as_ref().is_none_or(|ns| *ns == key.tray_ns)
            && self.marked.is_none_or(|m| m == tray.marked)
    }
    /// K1: the filter's tray namespace is an id, checked before anything
    /// reaches a backend.
    pub fn check(&self) -> crate::error::Result<()> {
        match &self.tray_ns {
            Some(ns) => crate::rules::check_id("tray_ns", ns),
            None => Ok(()),
        }
    }
}

/// Sorts an instance's trays in (tray_ns, tray_id) byte order, the order
/// `instance_trays` answers in (rule T7).
pub fn sort_trays(trays: &mut [(TrayKey, Tray)]) {
    trays.sort_by(|(a, _), (b, _)| (&a.tray_ns, &a.tray_id).cmp(&(&b.tray_ns, &b.tray_id)));
}

/// A marked tray as the sweeper sees it: whom to wake. It may gain fields
/// (more of what the worker wrote): a backend makes one with
/// [`MarkedTray::new`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct MarkedTray {
    /// The tray.
    pub key: TrayKey,
    /// The env of the worker that marked it.
    pub env: String,
    /// The host of the worker that marked it.
    pub hostname: String,
}

/// The tray name `(tray_ns, tray_id)` of an instance's alarm row, as the
/// seeds name it (rule A4): tray calls refuse it, and on PostgreSQL an
/// instance's alarm is also this row of `pinned_tray_index`, for a sweeper
/// reading the table with SQL.
pub const ALARM_TRAY: (&str, &str) = ("pinned", "alarm");

/// A due alarm (rule A2). It may gain fields: a backend makes one with
/// [`Alarm::new`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Alarm {
    /// Whose alarm.
    pub instance: InstanceKey,
    /// When it is due; pass it back to `ack_alarm`.
    pub due_at: Millis,
}

impl MarkedTray {
    /// The tray, and the env and host of the worker that marked it.
    pub fn new(key: TrayKey, env: impl Into<String>, hostname: impl Into<String>) -> Self {
        MarkedTray {
            key,
            env: env.into(),
            hostname: hostname.into(),
        }
    }
}

impl Alarm {
    /// The alarm of `instance`, due at `due_at`.
    pub fn new(instance: InstanceKey, due_at: Millis) -> Self {
        Alarm { instance, due_at }
    }
}

/// `ns/id`.
impl std::fmt::Display for InstanceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.ns, self.id)
    }
}

/// `ns/id/tray_ns/tray_id`.
impl std::fmt::Display for TrayKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}/{}",
            self.ns, self.id, self.tray_ns, self.tray_id
        )
    }
}
