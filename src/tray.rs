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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// One operation of a tray batch (rule T3).
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

/// A marked tray as the sweeper sees it: whom to wake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkedTray {
    /// The tray.
    pub key: TrayKey,
    /// The env of the worker that marked it.
    pub env: String,
    /// The host of the worker that marked it.
    pub hostname: String,
}

/// A due alarm (rule A2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Alarm {
    /// Whose alarm.
    pub instance: InstanceKey,
    /// When it is due; pass it back to `ack_alarm`.
    pub due_at: Millis,
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
