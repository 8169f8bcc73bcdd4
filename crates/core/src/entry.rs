//! Export entries: every record of a store, one entry each, in the same
//! shape on every backend (the export file's lines, `import`'s input).

use serde::{Deserialize, Serialize};

use crate::budget::{BudgetRecord, HoldRecord, Spend};
use crate::error::RecordKey;
use crate::record::{Millis, RunKey, RunRecord, SessionRecord};
use crate::tray::{InstanceKey, Tray, TrayKey};

/// One exported record. Serialized as one JSON object per line with a
/// `kind` field (`run`, `hold`, `session`, `budget`, `epoch`, `tray`,
/// `alarm`); see docs/cli.md, "Export format".
///
/// Exhaustive on purpose: every backend must export and import every
/// kind, so a new kind is a compile error in a backend that does not know
/// it rather than records an import would lose.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Entry {
    /// A run, exactly as stored.
    Run(RunRecord),
    /// A session, exactly as stored.
    Session(SessionRecord),
    /// An instance's stored epoch.
    Epoch {
        /// The instance.
        instance: InstanceKey,
        /// Its epoch.
        epoch: u64,
    },
    /// A tray.
    Tray {
        /// Its key.
        key: TrayKey,
        /// Its contents.
        tray: Tray,
    },
    /// A named tenant budget and what is spent against it (rule B1).
    Budget {
        /// The budget, exactly as stored.
        budget: BudgetRecord,
        /// Spent by the runs that draw from it.
        spent: Spend,
    },
    /// A run's hold (rule B2), live or expired-but-not-yet-removed.
    Hold {
        /// The run that holds it.
        run: RunKey,
        /// The hold.
        hold: HoldRecord,
    },
    /// An instance's alarm.
    Alarm {
        /// The instance.
        instance: InstanceKey,
        /// When it is due.
        due_at: Millis,
    },
}

impl Entry {
    /// Checks what an import checks of this entry alone, whatever the
    /// store: ids (K1), pending tool calls (K5), a run's `seq` and
    /// `version` and a budget's `version` at least 1. What depends on the
    /// store or on the other entries (a tray doc's size against the
    /// store's limit, a record or `seq` given twice) is checked by
    /// [`StoreAdmin::import`](crate::StoreAdmin::import). A reader of an
    /// export file calls this per line, so a bad entry is reported at its
    /// own line rather than when the import's group is written.
    ///
    /// ```
    /// use agentstate::{Entry, RunKey, RunRecord};
    /// let mut run = RunRecord::new(RunKey::new("acme", ""), "planner");
    /// (run.version, run.seq) = (1, 1);
    /// assert!(Entry::Run(run).check().is_err());
    /// ```
    pub fn check(&self) -> crate::Result<()> {
        crate::rules::check_entry(self, None)
    }

    /// The key of the record the entry holds (an epoch and an alarm are
    /// their instance's).
    pub fn record_key(&self) -> RecordKey {
        match self {
            Entry::Run(r) => RecordKey::Run(r.key.clone()),
            Entry::Session(s) => RecordKey::Session(s.key.clone()),
            Entry::Epoch { instance, .. } | Entry::Alarm { instance, .. } => {
                RecordKey::Instance(instance.clone())
            }
            Entry::Tray { key, .. } => RecordKey::Tray(key.clone()),
            Entry::Budget { budget, .. } => RecordKey::Budget(budget.key.clone()),
            Entry::Hold { run, hold } => RecordKey::Hold {
                run: run.clone(),
                hold_id: hold.id.clone(),
            },
        }
    }
}
