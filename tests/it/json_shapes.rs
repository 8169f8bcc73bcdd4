//! The JSON shapes of the public data types, against golden files
//! (`tests/fixtures/json/<type>.json`, one per type; enums hold every
//! variant): each test serializes fixed values and compares the text byte
//! for byte with the file, then reads the file back and compares the value
//! with the one it was written from. A change to a shape shows up here as
//! a diff, and is made on purpose: `AGENTSTATE_BLESS=1` rewrites the files
//! from the code (then review the diff, and say so in the CHANGELOG).

use std::fmt::Debug;
use std::path::PathBuf;

use agentstate::{
    Alarm, Amount, Approval, BudgetKey, BudgetRecord, BudgetStatus, CapLimit, CapScope, Caps,
    Cursor, Durability, Entry, FileEngine, Hold, HoldRecord, IdempotencyKey, IdempotencyWindow,
    InstanceKey, Label, Labels, MarkedTray, Page, PageRequest, PersistenceReason, RecordKey,
    RetryPolicy, RunKey, RunRecord, RunSpend, RunState, SessionKey, SessionRecord, Settled, Spend,
    StateDelta, StateError, StateQuery, StoreStats, TenantStats, ToolCall, Tray, TrayKey, TrayOp,
    UpgradeProgress, Usage, VerifyReport,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// 2023-11-14T22:13:20Z.
const T0: u64 = 1_700_000_000_000;

fn path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/json")
        .join(format!("{name}.json"))
}

/// The pretty JSON of `value` is the golden file `name` byte for byte
/// (or becomes it, under `AGENTSTATE_BLESS`); returns the file's text.
fn matches_file(name: &str, value: &impl Serialize) -> String {
    let path = path(name);
    let got = serde_json::to_string_pretty(value).expect("serializes") + "\n";
    if std::env::var_os("AGENTSTATE_BLESS").is_some() {
        std::fs::write(&path, &got).expect("write the golden file");
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with AGENTSTATE_BLESS=1 to write it, then review it",
            path.display()
        )
    });
    assert_eq!(got, want, "the JSON shape of {name} changed");
    want
}

/// `value`'s shape is the golden file `name`, and the file (and the
/// compact JSON of `value`) reads back as `value`.
fn golden<T>(name: &str, value: &T)
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let text = matches_file(name, value);
    let back: T = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{name}.json does not read back: {e}"));
    assert_eq!(&back, value, "{name}.json reads back as another value");
    let compact = serde_json::to_string(value).expect("serializes");
    let back: T = serde_json::from_str(&compact).expect("compact JSON reads back");
    assert_eq!(
        &back, value,
        "{name}: the compact JSON reads back as another value"
    );
}

fn run_key() -> RunKey {
    RunKey::new("acme", "run_1")
}

fn instance() -> InstanceKey {
    InstanceKey::new("pinned", "w1")
}

fn caps() -> Caps {
    Caps::new().cost_micros(5_000_000).tokens(200_000)
}

fn spend(cost_micros: u64, tokens: u64, iterations: u64) -> Spend {
    Spend {
        cost_micros,
        tokens,
        iterations,
    }
}

fn tool_call() -> ToolCall {
    ToolCall {
        id: "call_1".into(),
        name: "web_search".into(),
        arguments: r#"{"query":"flights to Lisbon","api_key":"[REDACTED]"}"#.into(),
    }
}

fn run_record() -> RunRecord {
    let mut r = RunRecord::new(run_key(), "planner")
        .with_session("s1")
        .with_caps(caps())
        .with_budget("monthly")
        .with_label("user", "u-42")
        .with_label("priority", 2)
        .with_label("trace", serde_json::json!({"id": "t-9", "sampled": true}));
    r.version = 3;
    r.state = RunState::AwaitingApproval;
    r.messages_read = 12;
    r.pending_tool_calls = vec![tool_call()];
    r.usage = Usage {
        input_tokens: 1_500,
        output_tokens: 320,
    };
    r.cost_micros = 4_200;
    r.iterations = 2;
    r.approval = Some(Approval {
        id: "appr_1".into(),
        prompt: "Book the 9:40 flight?".into(),
    });
    r.created_at = T0;
    r.updated_at = T0 + 60_000;
    r.seq = 17;
    r
}

fn session_record() -> SessionRecord {
    let mut s = SessionRecord::new(SessionKey::new("acme", "s1")).with_label("channel", "web");
    s.version = 2;
    s.metadata.insert("title".into(), "Trip to Lisbon".into());
    s.created_at = T0;
    s.updated_at = T0 + 5_000;
    s
}

fn budget_record() -> BudgetRecord {
    let mut b = BudgetRecord::new(BudgetKey::new("acme", "monthly"), caps());
    b.version = 1;
    b.created_at = T0;
    b.updated_at = T0;
    b
}

fn hold_record() -> HoldRecord {
    HoldRecord {
        id: "call-1".into(),
        amounts: spend(400_000, 2_000, 1),
        created_at: T0,
        expires_at: T0 + 60_000,
    }
}

fn tray(doc: &[u8]) -> Tray {
    Tray {
        marked: true,
        doc: doc.to_vec(),
        env: "prod".into(),
        hostname: "host-1".into(),
    }
}

#[test]
fn runs_and_sessions_have_a_stable_json_shape() {
    golden("run_key", &run_key());
    golden("run_state", &RunState::ALL.to_vec());
    golden(
        "usage",
        &Usage {
            input_tokens: 1_500,
            output_tokens: 320,
        },
    );
    golden("tool_call", &tool_call());
    golden("approval", &run_record().approval);
    golden("run_record", &run_record());
    golden(
        "state_delta",
        &StateDelta {
            usage: Usage {
                input_tokens: 10,
                output_tokens: 5,
            },
            cost_micros: 1_200,
            iterations: 1,
            messages_read: 2,
        },
    );
    golden("session_key", &SessionKey::new("acme", "s1"));
    golden("session_record", &session_record());
    golden(
        "labels",
        &Labels::new()
            .with("user", "u-42")
            .with("scores", serde_json::json!([1, 2, 3]))
            .with("deleted", serde_json::Value::Null),
    );
    golden("label", &Label::new("user", "u-42"));
}

#[test]
fn listings_have_a_stable_json_shape() {
    let everything = StateQuery::new("acme")
        .state(RunState::Running)
        .session("s1")
        .agent("planner")
        .updated_before(T0)
        .label("user", "u-42");
    golden(
        "state_query",
        &vec![StateQuery::new("acme"), everything.clone()],
    );
    // A query without a label filter has no `label` member, and one
    // written before labels existed reads back.
    let v = serde_json::to_value(StateQuery::new("acme")).unwrap();
    assert!(v.get("label").is_none(), "{v}");
    let old =
        r#"{"tenant":"acme","state":"running","session":null,"agent":null,"updated_before":null}"#;
    assert_eq!(
        serde_json::from_str::<StateQuery>(old).unwrap(),
        StateQuery::new("acme").state(RunState::Running)
    );

    let cursor = Cursor::from_text("v1.8f3a0c");
    golden("cursor", &cursor);
    golden(
        "page_request",
        &vec![
            PageRequest::new(50),
            PageRequest::new(50).after(Some(&cursor)),
        ],
    );
    let page = Page::new(vec![run_key(), RunKey::new("acme", "run_2")], Some(cursor)).unwrap();
    golden("page", &page);
    // Reading a page checks it as Page::new does.
    for bad in [
        r#"{"items":[],"cursor":"c"}"#.to_string(),
        format!(
            r#"{{"items":[{}],"cursor":null}}"#,
            vec![r#"{"tenant":"t","run_id":"r"}"#; 1001].join(",")
        ),
    ] {
        assert!(
            serde_json::from_str::<Page<RunKey>>(&bad).is_err(),
            "{}",
            &bad[..40]
        );
    }
}

#[test]
fn trays_and_alarms_have_a_stable_json_shape() {
    golden("instance_key", &instance());
    golden("tray_key", &instance().tray("state", "main"));
    golden(
        "tray_op",
        &vec![
            TrayOp::Put {
                tray_ns: "state".into(),
                tray_id: "main".into(),
                tray: tray(br#"{"step": 3}"#),
            },
            TrayOp::Delete {
                tray_ns: "state".into(),
                tray_id: "old".into(),
            },
        ],
    );
    golden(
        "marked_tray",
        &MarkedTray::new(instance().tray("state", "main"), "prod", "host-1"),
    );
    golden("alarm", &Alarm::new(instance(), T0));
}

/// A tray's doc is text when it is UTF-8 and base64 otherwise; both read
/// back, and so does the array of numbers earlier releases wrote.
#[test]
fn trays_show_their_doc_as_text_or_base64() {
    let text = tray(br#"{"step": 3}"#);
    let binary = tray(&[0, 1, 2, 0xff]);
    golden("tray", &vec![text.clone(), binary.clone()]);
    let old = r#"{"marked":false,"doc":[0,1,2,255],"env":"prod","hostname":"h"}"#;
    assert_eq!(
        serde_json::from_str::<Tray>(old).unwrap().doc,
        vec![0, 1, 2, 255]
    );
    let both = r#"{"marked":false,"doc":"a","doc_base64":"YQ==","env":"prod","hostname":"h"}"#;
    assert!(serde_json::from_str::<Tray>(both).is_err());
}

#[test]
fn budgets_have_a_stable_json_shape() {
    golden("caps", &caps());
    golden("amount", &Amount::ALL.to_vec());
    golden("spend", &spend(750_000, 2_000, 3));
    golden("budget_key", &BudgetKey::new("acme", "monthly"));
    golden("budget_record", &budget_record());
    golden(
        "hold",
        &Hold::new("call-1", 60_000)
            .cost_micros(400_000)
            .tokens(2_000)
            .iterations(1),
    );
    golden("hold_record", &hold_record());
    let scopes = vec![
        CapScope::Run(run_key()),
        CapScope::Budget(BudgetKey::new("acme", "monthly")),
    ];
    golden("cap_scope", &scopes);
    golden(
        "cap_limit",
        &CapLimit::new(scopes[1].clone(), Amount::CostMicros, 5_000_000),
    );
    golden("settled", &Settled::new(run_record(), spend(10_000, 0, 1)));
    golden(
        "budget_status",
        &BudgetStatus::new(
            budget_record(),
            spend(750_000, 2_000, 3),
            spend(400_000, 2_000, 1),
            1,
        ),
    );
    golden(
        "run_spend",
        &RunSpend::new(
            run_key(),
            caps(),
            Some("monthly".into()),
            spend(4_200, 1_820, 2),
            spend(400_000, 2_000, 1),
            vec![hold_record()],
        ),
    );
}

#[test]
fn admin_reports_have_a_stable_json_shape() {
    let mut tenant = TenantStats::default();
    tenant.runs_by_state.insert(RunState::Running, 3);
    tenant.runs_by_state.insert(RunState::Completed, 40);
    tenant.sessions = 5;
    tenant.budgets = 1;
    tenant.holds = 2;
    tenant.runs_at_cap = 1;
    golden("tenant_stats", &tenant);
    let mut stats = StoreStats::default();
    stats.tenants.insert("acme".into(), tenant);
    stats.trays = 4;
    stats.marked_trays = 1;
    stats.alarms = 2;
    stats.disk_bytes = 1_048_576;
    stats.backend = "file: fdatasync per commit group".into();
    golden("store_stats", &stats);
    let mut report = VerifyReport::default();
    report.runs = 43;
    report.sessions = 5;
    report.trays = 4;
    report.alarms = 2;
    report.entries = 120;
    report.problems = vec!["run acme/run_9: no state index entry".into()];
    golden("verify_report", &report);
    golden(
        "entry",
        &vec![
            Entry::Run(run_record()),
            Entry::Hold {
                run: run_key(),
                hold: hold_record(),
            },
            Entry::Session(session_record()),
            Entry::Budget {
                budget: budget_record(),
                spent: spend(750_000, 2_000, 3),
            },
            Entry::Epoch {
                instance: instance(),
                epoch: 7,
            },
            Entry::Tray {
                key: instance().tray("state", "main"),
                tray: tray(&[0, 1, 2, 0xff]),
            },
            Entry::Alarm {
                instance: instance(),
                due_at: T0,
            },
        ],
    );
}

#[test]
fn options_have_a_stable_json_shape() {
    golden(
        "durability",
        &vec![Durability::Immediate, Durability::Buffered],
    );
    golden("file_engine", &vec![FileEngine::Fjall, FileEngine::Sled]);
    golden("idempotency_window", &IdempotencyWindow::default());
    golden("retry_policy", &RetryPolicy::default());
    // Only a store makes progress reports; this one is read from JSON.
    let progress: UpgradeProgress =
        serde_json::from_value(serde_json::json!({"done": 40, "total": 100})).unwrap();
    assert_eq!((progress.done, progress.total), (40, 100));
    golden("upgrade_progress", &progress);
    golden(
        "idempotency_key",
        &IdempotencyKey::new("tool-call-42").unwrap(),
    );
    // A key read from JSON is checked like IdempotencyKey::new.
    for bad in [String::new(), "x".repeat(129)] {
        let json = serde_json::to_string(&bad).unwrap();
        assert!(serde_json::from_str::<IdempotencyKey>(&json).is_err());
    }
}

#[test]
fn the_change_feed_has_a_stable_json_shape() {
    use agentstate::{Change, ChangePage, Changed, FeedScope, Position};
    golden(
        "feed_scope",
        &vec![
            FeedScope::tenant("acme"),
            FeedScope::trays(),
            FeedScope::trays_in("prod"),
        ],
    );
    // Past 2^64 and past JSON's exact integers: a string.
    golden(
        "position",
        &vec![
            Position::START,
            Position::from_u128(7),
            Position::from_u128((1u128 << 64) + 3),
        ],
    );
    let key = instance().tray("state", "main");
    golden(
        "change_page",
        &ChangePage::new(
            vec![
                Change::new(Position::from_u128(1), Changed::Run { run: run_record() }),
                Change::new(
                    Position::from_u128(2),
                    Changed::RunDeleted { key: run_key() },
                ),
                Change::new(
                    Position::from_u128(3),
                    Changed::Session {
                        session: session_record(),
                    },
                ),
                Change::new(
                    Position::from_u128(4),
                    Changed::SessionDeleted {
                        key: SessionKey::new("acme", "s1"),
                    },
                ),
                Change::new(
                    Position::from_u128(5),
                    Changed::Tray {
                        key: key.clone(),
                        tray: tray(b"doc"),
                    },
                ),
                Change::new(Position::from_u128(6), Changed::TrayDeleted { key }),
                Change::new(
                    Position::from_u128(7),
                    Changed::Alarm {
                        alarm: Alarm::new(instance(), T0),
                    },
                ),
                Change::new(
                    Position::from_u128(8),
                    Changed::AlarmDeleted {
                        instance: instance(),
                    },
                ),
            ],
            Position::from_u128(8),
        ),
    );
}

/// One of each error, with every fact set.
fn errors() -> Vec<StateError> {
    let run = run_key();
    vec![
        StateError::Conflict {
            record: RecordKey::Run(run.clone()),
            expected: 3,
            actual: 4,
        },
        StateError::NotFound(RecordKey::Run(run.clone())),
        StateError::NotFound(RecordKey::Hold {
            run: run.clone(),
            hold_id: "h1".into(),
        }),
        StateError::Persistence {
            reason: PersistenceReason::OutcomeUnknown { keyed: true },
            detail: "connection lost after COMMIT".into(),
            source: None,
        },
        StateError::Persistence {
            reason: PersistenceReason::Unavailable,
            detail: "syncing the journal: no space left on device".into(),
            source: Some(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "no space left on device",
            )),
        },
        StateError::InUse {
            record: RecordKey::Session(SessionKey::new("acme", "s1")),
            runs: vec![run.clone(), RunKey::new("acme", "run_3")],
        },
        StateError::FenceLost {
            instance: instance(),
            caller: 4,
            stored: 7,
        },
        StateError::FeedPruned {
            scope: agentstate::FeedScope::tenant("acme"),
            horizon: agentstate::Position::from_u128(42),
        },
        StateError::BudgetExceeded {
            limit: CapLimit::new(
                CapScope::Budget(BudgetKey::new("acme", "monthly")),
                Amount::CostMicros,
                1_000,
            ),
            spent: 900,
            held: 50,
            asked: 100,
        },
        StateError::Invalid {
            what: "run_id: 1..=256 bytes, got 0".into(),
        },
        StateError::Corrupt {
            what: "run acme/run_1: checksum mismatch".into(),
        },
        StateError::UnsupportedFormat {
            found: 9,
            supported: 4,
        },
        StateError::Locked {
            path: "/var/lib/agent/state".into(),
            this_process: false,
        },
    ]
}

/// The facts an error is compared by: it has no `PartialEq` (its source
/// is an `io::Error`).
fn facts(e: &StateError) -> (serde_json::Value, String, bool, Option<String>) {
    (
        serde_json::to_value(e).unwrap(),
        e.to_string(),
        e.is_retryable(),
        std::error::Error::source(e).map(|s| s.to_string()),
    )
}

#[test]
fn errors_have_a_stable_json_shape_and_read_back() {
    let errors = errors();
    let text = matches_file("errors", &errors);
    let back: Vec<StateError> = serde_json::from_str(&text).expect("errors.json reads back");
    assert_eq!(back.len(), errors.len());
    for (e, b) in errors.iter().zip(&back) {
        assert_eq!(facts(b), facts(e), "{e:?} read back as {b:?}");
        assert_eq!(
            std::mem::discriminant(b),
            std::mem::discriminant(e),
            "{e:?}"
        );
    }
    let v = serde_json::to_value(&errors[0]).unwrap();
    assert_eq!(v["kind"], "conflict");
    assert_eq!(v["retryable"], false);
    assert_eq!(serde_json::to_value(&errors[3]).unwrap()["retryable"], true);
    // A source crosses as its text.
    assert_eq!(
        serde_json::to_value(&errors[4]).unwrap()["source"],
        "no space left on device"
    );

    golden(
        "record_key",
        &vec![
            RecordKey::Run(run_key()),
            RecordKey::Session(SessionKey::new("acme", "s1")),
            RecordKey::Tray(instance().tray("state", "main")),
            RecordKey::Budget(BudgetKey::new("acme", "monthly")),
            RecordKey::Hold {
                run: run_key(),
                hold_id: "h1".into(),
            },
            RecordKey::Instance(instance()),
        ],
    );
    golden(
        "persistence_reason",
        &vec![
            PersistenceReason::Unavailable,
            PersistenceReason::OutcomeUnknown { keyed: false },
            PersistenceReason::TooLarge,
            PersistenceReason::ReadOnly,
            PersistenceReason::Refused,
            PersistenceReason::InvalidPath,
        ],
    );
}

/// `message` and `retryable` follow from the facts: reading ignores them
/// (and members it does not know); a kind it does not know, or a kind
/// without its facts, is an error naming what is wrong.
#[test]
fn errors_read_from_their_facts() {
    let json = r#"{"kind":"conflict","message":"stale text","retryable":true,
        "record":{"session":{"tenant":"acme","session_id":"s1"}},"expected":1,"actual":2,
        "added_by_a_newer_release":[1,2]}"#;
    let e: StateError = serde_json::from_str(json).unwrap();
    assert_eq!(
        e.to_string(),
        "version conflict on session acme/s1: expected 1, stored 2"
    );
    assert!(!e.is_retryable());
    let unknown = serde_json::from_str::<StateError>(r#"{"kind":"throttled","message":"m"}"#)
        .unwrap_err()
        .to_string();
    assert!(unknown.contains("throttled"), "{unknown}");
    let missing =
        serde_json::from_str::<StateError>(r#"{"kind":"fence_lost","caller":1,"stored":2}"#)
            .unwrap_err()
            .to_string();
    assert!(missing.contains("instance"), "{missing}");
}

#[test]
fn keys_and_states_display_as_people_write_them() {
    assert_eq!(RunKey::new("acme", "run_1").to_string(), "acme/run_1");
    assert_eq!(SessionKey::new("acme", "s").to_string(), "acme/s");
    assert_eq!(RunState::AwaitingApproval.to_string(), "awaiting_approval");
    for st in RunState::ALL {
        assert_eq!(st.to_string(), st.as_str());
        assert_eq!(st.to_string().parse::<RunState>().unwrap(), st);
    }
    let i = InstanceKey::new("pinned", "w1");
    assert_eq!(i.to_string(), "pinned/w1");
    let t: TrayKey = i.tray("state", "main");
    assert_eq!(t.to_string(), "pinned/w1/state/main");
    assert_eq!(
        BudgetKey::new("acme", "monthly").to_string(),
        "acme/monthly"
    );
    assert_eq!(
        RecordKey::Run(RunKey::new("acme", "run_1")).to_string(),
        "run acme/run_1"
    );
    // Names pad like text in the CLI's aligned output.
    assert_eq!(format!("[{:<9}]", RunState::Running), "[running  ]");
    assert_eq!(format!("[{:>8}]", Amount::Tokens), "[  tokens]");
    assert_eq!(
        CapLimit::new(
            CapScope::Run(RunKey::new("acme", "run_1")),
            Amount::Iterations,
            5
        )
        .to_string(),
        "run acme/run_1 iterations cap 5"
    );
}
