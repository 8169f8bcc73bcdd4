//! The key-value store's keyspace: its table bytes and meta keys. Keys
//! are built and read with the shared key codec (`codec::key`, rule K6).

/// Table bytes: each table is a key prefix in one ordered keyspace.
pub mod table {
    /// KvStore-wide values: format version, next seq, commit counter, secret.
    pub const META: u8 = 0x01;
    /// (tenant, seq) → RunRecord: a tenant's runs clustered in `seq`
    /// order, so a plain listing page is one range scan (store format 2).
    pub const RUN: u8 = 0x08;
    /// (tenant, run_id) → seq: where a run is, for point reads.
    pub const RUN_ID: u8 = 0x09;
    /// (tenant, state, seq) → the RunRecord again while the state is
    /// unfinished (a reaper's page is one range scan); a `RunSummary` once
    /// finished.
    pub const RUN_BY_STATE: u8 = 0x0A;
    /// (tenant, session, seq) → RunSummary.
    pub const RUN_BY_SESSION: u8 = 0x0B;
    /// (tenant, state, updated_at, seq) → (), unfinished runs only: which
    /// runs of a state were last written before a moment, without reading
    /// the others.
    pub const RUN_BY_TOUCH: u8 = 0x0C;
    /// (tenant, label key, label value's canonical JSON, seq) → (): the
    /// runs carrying a label (rule R11), so a label's listing is one range
    /// scan.
    pub const RUN_BY_LABEL: u8 = 0x0D;
    /// (tenant, run_id, hold_id) → HoldRecord (rule B2).
    pub const HOLD: u8 = 0x14;
    /// (tenant, session_id) → SessionRecord.
    pub const SESSION: u8 = 0x20;
    /// (tenant, name) → BudgetRecord and what is spent against it (B1).
    pub const BUDGET: u8 = 0x21;
    /// (tenant, budget name, run_id, hold_id) → HoldRecord: a budget's
    /// holds, so one scan sums them.
    pub const BUDGET_HOLD: u8 = 0x22;
    /// (ns, id) → epoch.
    pub const EPOCH: u8 = 0x30;
    /// (ns, id, tray_ns, tray_id) → Tray.
    pub const TRAY: u8 = 0x31;
    /// (ns, id, tray_ns, tray_id) → (env, hostname), while marked.
    pub const MARKED: u8 = 0x32;
    /// (env, ns, id, tray_ns, tray_id) → (env, hostname), while marked.
    pub const MARKED_BY_ENV: u8 = 0x33;
    /// (ns, id) → due_at.
    pub const ALARM: u8 = 0x40;
    /// (due_at, ns, id) → ().
    pub const ALARM_BY_DUE: u8 = 0x41;
    /// (scope kind, scope, idempotency key) → `Remembered` (rules I1–I6).
    pub const IDEM: u8 = 0x50;
    /// (scope kind, scope, ordinal) → (key, at): a scope's keys, oldest
    /// first, for pruning the window.
    pub const IDEM_ORDER: u8 = 0x51;
    /// (scope kind, scope) → (next ordinal, keys kept).
    pub const IDEM_SCOPE: u8 = 0x52;
    /// (scope, position) → the record's key (and a run's id): the change
    /// feed (rules F1–F9), one entry per record at its last change. A
    /// scope is `FEED_TENANT` + tenant, `FEED_TRAYS`, or `FEED_ENV` + env.
    pub const FEED: u8 = 0x60;
    /// (record key) → its feed position (and a run's id, a tray's env).
    pub const FEED_AT: u8 = 0x61;
    /// (scope) → the position a feed was pruned through.
    pub const FEED_HORIZON: u8 = 0x62;
    /// An import being built: the whole key of a live table after this
    /// byte (see `kv::transfer`). Past every exported table, so listings,
    /// exports, `is_empty` and `verify` never see it.
    pub const STAGE: u8 = 0x7F;

    /// Store format 1's run tables, read only by the upgrade
    /// (`kv::upgrade`) and never written.
    pub mod v1 {
        /// (tenant, run_id) → RunRecord.
        pub const RUN: u8 = 0x10;
        /// (tenant, seq) → run_id.
        pub const RUN_BY_SEQ: u8 = 0x11;
        /// (tenant, state, seq) → run_id.
        pub const RUN_BY_STATE: u8 = 0x12;
        /// (tenant, session, seq) → run_id.
        pub const RUN_BY_SESSION: u8 = 0x13;
    }
}

/// `key` moved into the staging table.
pub(crate) fn staged(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(table::STAGE);
    k.extend_from_slice(key);
    k
}

/// Meta keys (table META, then one byte).
pub(crate) mod meta {
    pub const FORMAT: &[u8] = &[super::table::META, b'f'];
    pub const NEXT_SEQ: &[u8] = &[super::table::META, b's'];
    pub const COMMITS: &[u8] = &[super::table::META, b'c'];
    pub const SECRET: &[u8] = &[super::table::META, b'k'];
    /// Present while a staged import is being moved into the live tables:
    /// holds the `next_seq` the store has once it is (see `kv::transfer`).
    pub const PUBLISHING: &[u8] = &[super::table::META, b'i'];
    /// Never written: `compact` deletes it to move the engine's sequence
    /// number past every write before it (see `FjallEngine::compact`).
    pub const COMPACT_MARK: &[u8] = &[super::table::META, b'x'];
    /// The next change-feed position; absent in a store from before the
    /// feed, whose open adds every record to it.
    pub const NEXT_FEED: &[u8] = &[super::table::META, b'p'];
    /// Present once every record has a feed entry (a new store, or an
    /// older one after its open filled the feed).
    pub const FEED_FILLED: &[u8] = &[super::table::META, b'e'];
}
