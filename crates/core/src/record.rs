//! Runs, sessions and queries: the records the store keeps.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::budget::Caps;
use crate::error::{Result, StateError};
use crate::labels::{Label, Labels};

/// Milliseconds since the Unix epoch, as read from the store's [`Clock`](crate::Clock).
pub type Millis = u64;

/// The key of a run (rule R1). The tenant is part of every key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RunKey {
    /// The owner of the run.
    pub tenant: String,
    /// The run's id, unique within the tenant.
    pub run_id: String,
}

impl RunKey {
    /// A key from its two parts.
    pub fn new(tenant: impl Into<String>, run_id: impl Into<String>) -> Self {
        RunKey {
            tenant: tenant.into(),
            run_id: run_id.into(),
        }
    }
}

/// Where a run is in its life. In JSON: its name in snake case
/// (`"awaiting_approval"`), as [`RunState::as_str`] and `Display` give it.
///
/// Exhaustive on purpose: the states are the contract's (rule R9), and a
/// new one would change what every caller must handle, so a `match` that
/// misses it should fail to compile rather than fall into a wildcard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// Created, not started.
    Pending,
    /// A worker is on it.
    Running,
    /// Held until an approval arrives.
    AwaitingApproval,
    /// Paused by its owner.
    Paused,
    /// Finished well.
    Completed,
    /// Finished badly.
    Failed,
    /// Stopped by its owner.
    Cancelled,
}

impl RunState {
    /// Every state, in declaration order.
    pub const ALL: [RunState; 7] = [
        RunState::Pending,
        RunState::Running,
        RunState::AwaitingApproval,
        RunState::Paused,
        RunState::Completed,
        RunState::Failed,
        RunState::Cancelled,
    ];

    /// True for `Completed`, `Failed` and `Cancelled`: states a run never
    /// leaves (rule R9). A `put_run` that moves a finished run to any other
    /// state is `Invalid` naming the state; `patch_run` still adds to it.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            RunState::Completed | RunState::Failed | RunState::Cancelled
        )
    }

    /// The lower-case name used by the CLI and the export format.
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Pending => "pending",
            RunState::Running => "running",
            RunState::AwaitingApproval => "awaiting_approval",
            RunState::Paused => "paused",
            RunState::Completed => "completed",
            RunState::Failed => "failed",
            RunState::Cancelled => "cancelled",
        }
    }

    pub fn tag(self) -> u8 {
        self as u8
    }
}

impl std::str::FromStr for RunState {
    type Err = StateError;
    fn from_str(s: &str) -> Result<Self> {
        RunState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| StateError::invalid(format!("state {s:?}: expected one of pending, running, awaiting_approval, paused, completed, failed, cancelled")))
    }
}

/// Token counts. Accumulates through [`StateDelta`] only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Completion tokens.
    pub output_tokens: u64,
}

/// A tool call that was asked for and has not come back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments, as JSON text. Scrubbed of secrets on every write.
    pub arguments: String,
}

/// The approval a run is held on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    /// The approval request's id.
    pub id: String,
    /// What is being asked, for the human who answers.
    pub prompt: String,
}

/// One agent run: enough to resume it, and no more (rule R7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Tenant and run id.
    pub key: RunKey,
    /// The version the caller read; 0 to create. The store returns the
    /// committed version.
    pub version: u64,
    /// Where the run is.
    pub state: RunState,
    /// The agent that runs it.
    pub agent_name: String,
    /// The session the run belongs to, fixed at create.
    pub session_id: Option<String>,
    /// How many messages the run has consumed (its message cursor).
    pub messages_read: u64,
    /// Tool calls asked for and not yet answered.
    pub pending_tool_calls: Vec<ToolCall>,
    /// Tokens spent.
    pub usage: Usage,
    /// Money spent, in millionths.
    pub cost_micros: u64,
    /// Loop passes made.
    pub iterations: u64,
    /// The approval the run waits on, if any.
    pub approval: Option<Approval>,
    /// Set by the store at create, from its clock.
    pub created_at: Millis,
    /// Set by the store on every write, from its clock.
    pub updated_at: Millis,
    /// The store's insertion counter, assigned at create. Listings are in
    /// `seq` order.
    pub seq: u64,
    /// The run's own spend caps (rule B1), fixed at create. Absent in
    /// exports of earlier releases: no caps.
    #[serde(default)]
    pub caps: Caps,
    /// The named tenant budget the run draws from (rule B1), fixed at
    /// create; it must exist then.
    #[serde(default)]
    pub budget: Option<String>,
    /// The application's own fields (rule R11): keys to JSON values,
    /// scrubbed on every write, within [`LABELS_MAX`](crate::limits::LABELS_MAX)
    /// and the key and value limits. Replaced whole by a put, untouched by
    /// a patch. Absent in exports of earlier releases: none.
    #[serde(default)]
    pub labels: Labels,
}

impl RunRecord {
    /// A new run in state `Pending`, ready to create with `put_run`.
    pub fn new(key: RunKey, agent_name: impl Into<String>) -> Self {
        RunRecord {
            key,
            version: 0,
            state: RunState::Pending,
            agent_name: agent_name.into(),
            session_id: None,
            messages_read: 0,
            pending_tool_calls: Vec::new(),
            usage: Usage::default(),
            cost_micros: 0,
            iterations: 0,
            approval: None,
            created_at: 0,
            updated_at: 0,
            seq: 0,
            caps: Caps::default(),
            budget: None,
            labels: Labels::new(),
        }
    }

    /// Sets label `key` to `value` (rule R11).
    pub fn with_label(
        mut self,
        key: impl Into<String>,
        value: impl Into<serde_json::Value>,
    ) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Sets the run's caps (only honoured at create; rule B1).
    pub fn with_caps(mut self, caps: Caps) -> Self {
        self.caps = caps;
        self
    }

    /// Draws the run from the tenant's named budget (only honoured at
    /// create; the budget must exist).
    pub fn with_budget(mut self, name: impl Into<String>) -> Self {
        self.budget = Some(name.into());
        self
    }

    /// Sets the session (only honoured at create).
    pub fn with_session(mut self, session_id: impl Into<String>) -> Self {
        self.session_id = Some(session_id.into());
        self
    }

    /// True while any tool call is pending: a run stopped here is a state,
    /// not a corruption.
    pub fn mid_tool_call(&self) -> bool {
        !self.pending_tool_calls.is_empty()
    }

    /// This record with every tool call's arguments scrubbed by the default
    /// rules (rule X1). The store applies its own scrubber on every write.
    pub fn scrubbed(&self) -> RunRecord {
        crate::scrub::Scrubber::default().scrub_run(self)
    }
}

/// Amounts to add to a run (rule R4). Additions commute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateDelta {
    /// Tokens to add.
    pub usage: Usage,
    /// Cost to add, in millionths.
    pub cost_micros: u64,
    /// Loop passes to add.
    pub iterations: u64,
    /// How far to advance the message cursor.
    pub messages_read: u64,
}

/// The key of a session.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SessionKey {
    /// The owner.
    pub tenant: String,
    /// The session's id, unique within the tenant.
    pub session_id: String,
}

impl SessionKey {
    /// A key from its two parts.
    pub fn new(tenant: impl Into<String>, session_id: impl Into<String>) -> Self {
        SessionKey {
            tenant: tenant.into(),
            session_id: session_id.into(),
        }
    }
}

/// A conversation across runs; versioned like a run (rule S1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// Tenant and session id.
    pub key: SessionKey,
    /// The version the caller read; 0 to create.
    pub version: u64,
    /// Free-form labels (title, user, channel…).
    pub metadata: BTreeMap<String, String>,
    /// Set by the store at create.
    pub created_at: Millis,
    /// Set by the store on every write.
    pub updated_at: Millis,
    /// The application's own fields, as on a run (rule R11). Absent in
    /// exports of earlier releases: none.
    #[serde(default)]
    pub labels: Labels,
}

impl SessionRecord {
    /// A new session, ready to create with `put_session`.
    pub fn new(key: SessionKey) -> Self {
        SessionRecord {
            key,
            version: 0,
            metadata: BTreeMap::new(),
            created_at: 0,
            updated_at: 0,
            labels: Labels::new(),
        }
    }

    /// Sets label `key` to `value` (rule R11).
    pub fn with_label(
        mut self,
        key: impl Into<String>,
        value: impl Into<serde_json::Value>,
    ) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }
}

/// The filters of a listing of runs (rule L1); the page is a
/// [`PageRequest`](crate::PageRequest). Built with [`StateQuery::new`] and
/// its filter methods; more filters may come, so it cannot be built as a
/// struct literal outside this crate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct StateQuery {
    /// Whose runs.
    pub tenant: String,
    /// Only runs in this state.
    pub state: Option<RunState>,
    /// Only runs of this session.
    pub session: Option<String>,
    /// Only runs of this agent.
    pub agent: Option<String>,
    /// Only runs last written before this moment (a filter, never an order).
    pub updated_before: Option<Millis>,
    /// Only runs carrying this exact label (rule R11), through an index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<Label>,
}

impl StateQuery {
    /// All runs of a tenant.
    pub fn new(tenant: impl Into<String>) -> Self {
        StateQuery {
            tenant: tenant.into(),
            state: None,
            session: None,
            agent: None,
            updated_before: None,
            label: None,
        }
    }
    /// Only runs whose label `key` holds `value` (rule R11).
    pub fn label(mut self, key: impl Into<String>, value: impl Into<serde_json::Value>) -> Self {
        self.label = Some(Label::new(key, value));
        self
    }
    /// Only runs in `state`.
    pub fn state(mut self, state: RunState) -> Self {
        self.state = Some(state);
        self
    }
    /// Only runs of `session`.
    pub fn session(mut self, session: impl Into<String>) -> Self {
        self.session = Some(session.into());
        self
    }
    /// Only runs of `agent`.
    pub fn agent(mut self, agent: impl Into<String>) -> Self {
        self.agent = Some(agent.into());
        self
    }
    /// Only runs last written before `t`.
    pub fn updated_before(mut self, t: Millis) -> Self {
        self.updated_before = Some(t);
        self
    }
}

/// `tenant/run_id`, for messages and logs.
impl std::fmt::Display for RunKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.tenant, self.run_id)
    }
}

/// `tenant/session_id`.
impl std::fmt::Display for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.tenant, self.session_id)
    }
}

/// The state's name as stored, parsed and printed by the CLI (`running`,
/// `awaiting_approval`); width and alignment apply (`{:<18}`).
impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}
