//! The JSON shapes of the public types an HTTP API returns, against golden
//! files (`tests/fixtures/json/*.json`): a change to a shape shows up here
//! as a diff, and is made on purpose. `AGENTSTATE_BLESS=1` rewrites the
//! files from the code (then review the diff).

use std::path::PathBuf;

use agentstate::{
    Alarm, Amount, BudgetKey, CapLimit, CapScope, InstanceKey, MarkedTray, Missing, PageRequest,
    PersistenceReason, RunKey, RunState, SessionKey, StateError, StateQuery, StoreStats,
    VerifyReport,
};

fn golden(name: &str, value: &impl serde::Serialize) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/json")
        .join(format!("{name}.json"));
    let got = serde_json::to_string_pretty(value).expect("serializes") + "\n";
    if std::env::var_os("AGENTSTATE_BLESS").is_some() {
        std::fs::write(&path, &got).expect("write the golden file");
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with AGENTSTATE_BLESS=1 to write it, then review it",
            path.display()
        )
    });
    assert_eq!(got, want, "the JSON shape of {name} changed");
}

#[test]
fn errors_have_a_stable_json_shape() {
    let run = RunKey::new("acme", "run_1");
    let errors = vec![
        StateError::Conflict {
            record: Missing::Run(run.clone()),
            expected: 3,
            actual: 4,
        },
        StateError::NotFound(Missing::Run(run.clone())),
        StateError::NotFound(Missing::Hold {
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
            detail: "connect 127.0.0.1:5432: refused".into(),
            source: None,
        },
        StateError::InUse {
            record: Missing::Session(SessionKey::new("acme", "s1")),
            runs: vec![run.clone()],
        },
        StateError::FenceLost {
            instance: InstanceKey::new("pinned", "w1"),
            caller: 4,
            stored: 7,
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
    ];
    golden("errors", &errors);
    let v = serde_json::to_value(&errors[0]).unwrap();
    assert_eq!(v["kind"], "conflict");
    assert_eq!(v["retryable"], false);
    assert_eq!(serde_json::to_value(&errors[3]).unwrap()["retryable"], true);
}

#[test]
fn listing_and_admin_types_have_a_stable_json_shape() {
    let q = StateQuery::new("acme")
        .state(RunState::Running)
        .updated_before(1_700_000_000_000);
    golden("state_query", &q);
    let back: StateQuery = serde_json::from_value(serde_json::to_value(&q).unwrap()).unwrap();
    assert_eq!(back, q);
    golden("page_request", &PageRequest::new(50));
    let i = InstanceKey::new("pinned", "w1");
    golden(
        "sweeper",
        &(
            MarkedTray::new(i.tray("state", "main"), "prod", "host-1"),
            Alarm::new(i.clone(), 1_700_000_000_000),
        ),
    );
    golden("stats", &(StoreStats::default(), VerifyReport::default()));
}

#[test]
fn keys_and_states_display_as_people_write_them() {
    assert_eq!(RunKey::new("acme", "run_1").to_string(), "acme/run_1");
    assert_eq!(SessionKey::new("acme", "s").to_string(), "acme/s");
    assert_eq!(RunState::AwaitingApproval.to_string(), "awaiting_approval");
    let i = InstanceKey::new("pinned", "w1");
    assert_eq!(i.to_string(), "pinned/w1");
    assert_eq!(i.tray("state", "main").to_string(), "pinned/w1/state/main");
    assert_eq!(
        BudgetKey::new("acme", "monthly").to_string(),
        "acme/monthly"
    );
}

/// A tray's doc is text when it is UTF-8 and base64 otherwise; both read
/// back, and so does the array of numbers earlier releases wrote.
#[test]
fn trays_show_their_doc_as_text_or_base64() {
    let text = agentstate::Tray {
        marked: true,
        doc: br#"{"step": 3}"#.to_vec(),
        env: "prod".into(),
        hostname: "host-1".into(),
    };
    let binary = agentstate::Tray {
        doc: vec![0, 1, 2, 0xff],
        ..text.clone()
    };
    golden("trays", &vec![text.clone(), binary.clone()]);
    for t in [&text, &binary] {
        let json = serde_json::to_string(t).unwrap();
        assert_eq!(&serde_json::from_str::<agentstate::Tray>(&json).unwrap(), t);
    }
    let old = r#"{"marked":false,"doc":[0,1,2,255],"env":"prod","hostname":"h"}"#;
    assert_eq!(
        serde_json::from_str::<agentstate::Tray>(old).unwrap().doc,
        vec![0, 1, 2, 255]
    );
    let both = r#"{"marked":false,"doc":"a","doc_base64":"YQ==","env":"prod","hostname":"h"}"#;
    assert!(serde_json::from_str::<agentstate::Tray>(both).is_err());
}
