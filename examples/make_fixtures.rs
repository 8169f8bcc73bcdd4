//! Writes the golden fixture store that `tests/it/durability.rs` (rule D4)
//! opens with every later release:
//!
//! ```text
//! cargo run --example make_fixtures -- tests/fixtures/v2
//! ```
//!
//! The content is deterministic (a `ManualClock`, fixed ids and amounts);
//! the bytes are not (fjall's files and the store's cursor secret differ per
//! run), which is why the test compares records, never files. Regenerate a
//! fixture only when its format version is new: `v1` must stay what release
//! 0.1 wrote (store format 1) and `v2` what the release that introduced
//! store format 2 wrote, so that the test keeps proving old stores open.

use std::collections::BTreeMap;
use std::sync::Arc;

use agentstate::{
    Approval, FileStore, InstanceKey, ManualClock, Options, RunKey, RunRecord, RunState,
    SessionKey, SessionRecord, StateDelta, StateStore, StoreAdmin, ToolCall, Tray, TrayOp,
    TrayStore, Usage,
};

/// The clock's reading at the first write; every write advances it 1 s.
const START_MILLIS: u64 = 1_700_000_000_000;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: make_fixtures <dir> (e.g. tests/fixtures/v1)")?;
    let path = std::path::Path::new(&dir);
    if path.exists() {
        return Err(format!(
            "{dir} exists; remove it first (fixtures are never rewritten in place)"
        )
        .into());
    }
    let clock = Arc::new(ManualClock::new(START_MILLIS));
    let store = FileStore::open_with(path, Options::new().clock(clock.clone()))?;
    let tick = || clock.advance(1_000);
    write(&store, &tick)?;
    let report = store.verify()?;
    assert!(
        report.is_ok(),
        "fixture does not verify: {:?}",
        report.problems
    );
    drop(store);
    println!("wrote {dir}");
    Ok(())
}

fn write(store: &FileStore, tick: &dyn Fn()) -> Res<()> {
    let mut meta = BTreeMap::new();
    meta.insert("title".to_string(), "Fixture session".to_string());
    meta.insert("user".to_string(), "u_42".to_string());
    let mut session = SessionRecord::new(SessionKey::new("acme", "s1"));
    session.metadata = meta;
    let session = store.put_session(session)?;
    tick();
    // Version 2 of the session: a label added later.
    let mut session2 = session.clone();
    session2
        .metadata
        .insert("channel".to_string(), "web".to_string());
    store.put_session(session2)?;
    tick();

    // acme/r_pending: created, never touched again.
    store.put_run(RunRecord::new(RunKey::new("acme", "r_pending"), "planner"))?;
    tick();

    // acme/r_running: in the session, running, with spend.
    let r = store
        .put_run(RunRecord::new(RunKey::new("acme", "r_running"), "planner").with_session("s1"))?;
    tick();
    let mut r = r;
    r.state = RunState::Running;
    store.put_run(r.clone())?;
    tick();
    let delta = StateDelta {
        usage: Usage {
            input_tokens: 1_200,
            output_tokens: 340,
        },
        cost_micros: 5_250,
        iterations: 2,
        messages_read: 3,
    };
    store.patch_run(&r.key, delta)?;
    tick();

    // acme/r_tools: stopped mid tool call.
    let mut r = store
        .put_run(RunRecord::new(RunKey::new("acme", "r_tools"), "coder").with_session("s1"))?;
    tick();
    r.state = RunState::Running;
    r.pending_tool_calls = vec![
        ToolCall {
            id: "call_1".into(),
            name: "search".into(),
            arguments: r#"{"q":"rust fjall"}"#.into(),
        },
        ToolCall {
            id: "call_2".into(),
            name: "read_file".into(),
            arguments: r#"{"path":"src/lib.rs"}"#.into(),
        },
    ];
    store.put_run(r)?;
    tick();

    // acme/r_approval: held on an approval, with a pending call.
    let mut r = store.put_run(RunRecord::new(RunKey::new("acme", "r_approval"), "mailer"))?;
    tick();
    r.state = RunState::AwaitingApproval;
    r.approval = Some(Approval {
        id: "ap_1".into(),
        prompt: "Send the email to the board?".into(),
    });
    r.pending_tool_calls = vec![ToolCall {
        id: "call_9".into(),
        name: "send_email".into(),
        arguments: r#"{"to":"board@example.com"}"#.into(),
    }];
    store.put_run(r)?;
    tick();

    // acme/r_done: in the session, completed after one patch.
    let mut r = store
        .put_run(RunRecord::new(RunKey::new("acme", "r_done"), "planner").with_session("s1"))?;
    tick();
    r = store.patch_run(
        &r.key,
        StateDelta {
            cost_micros: 900,
            iterations: 1,
            ..Default::default()
        },
    )?;
    tick();
    r.state = RunState::Completed;
    store.put_run(r)?;
    tick();

    // acme/r_failed and globex/r_paused.
    let mut r = store.put_run(RunRecord::new(RunKey::new("acme", "r_failed"), "coder"))?;
    tick();
    r.state = RunState::Failed;
    store.put_run(r)?;
    tick();
    let mut r = store.put_run(RunRecord::new(RunKey::new("globex", "r_paused"), "planner"))?;
    tick();
    r.state = RunState::Paused;
    store.put_run(r)?;
    tick();

    // Trays of workers/w1 at epoch 3, marked and unmarked; w2 at epoch 1.
    let w1 = InstanceKey::new("workers", "w1");
    let tray = |marked: bool, doc: &[u8], env: &str| Tray {
        marked,
        doc: doc.to_vec(),
        env: env.to_string(),
        hostname: "host-a".to_string(),
    };
    store.apply_batch(
        &w1,
        3,
        vec![
            TrayOp::Put {
                tray_ns: "inbox".into(),
                tray_id: "t1".into(),
                tray: tray(true, b"hello", "prod"),
            },
            TrayOp::Put {
                tray_ns: "inbox".into(),
                tray_id: "t2".into(),
                tray: tray(false, b"world", "prod"),
            },
            TrayOp::Put {
                tray_ns: "state".into(),
                tray_id: "main".into(),
                tray: tray(true, &[0, 1, 2, 255], "dev"),
            },
            TrayOp::Put {
                tray_ns: "inbox".into(),
                tray_id: "gone".into(),
                tray: tray(true, b"x", "prod"),
            },
        ],
    )?;
    tick();
    store.delete_tray(&w1.tray("inbox", "gone"), 3)?;
    tick();
    store.set_alarm(&w1, 3, 1_700_000_100_000)?;
    tick();
    let w2 = InstanceKey::new("workers", "w2");
    store.write_tray(
        &w2.tray("state", "main"),
        1,
        tray(false, b"{\"n\":1}", "prod"),
    )?;
    tick();
    store.set_alarm(&w2, 1, 1_700_000_050_000)?;
    tick();
    // Replaced: only the second alarm of w2 remains.
    store.set_alarm(&w2, 1, 1_700_000_060_000)?;
    tick();
    Ok(())
}
