//! Spend caps beyond the conformance suite: a hold survives a reopen of
//! the file store (and expires by the clock after it), budgets and holds
//! round-trip through export and import, `verify` checks them, `stats`
//! counts them, and the async wrapper mirrors the calls.

use std::sync::Arc;

use agentstate::{
    BudgetKey, BudgetRecord, BudgetStore, Caps, Entry, FileStore, Hold, ManualClock, MemoryStore,
    Options, RunKey, RunRecord, StateDelta, StateError, StateStore, StoreAdmin,
};

fn cost(n: u64) -> StateDelta {
    StateDelta {
        cost_micros: n,
        ..Default::default()
    }
}

fn export(store: &dyn StoreAdmin) -> Vec<Entry> {
    store
        .iter_export()
        .page_size(2)
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
}

#[test]
fn b2_a_hold_survives_a_reopen_of_the_file_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state");
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let open = || FileStore::open_with(&path, Options::new().clock(clock.clone())).unwrap();
    let bk = BudgetKey::new("acme", "monthly");
    let a = RunKey::new("acme", "a");
    let b = RunKey::new("acme", "b");
    {
        let s = open();
        s.put_budget(BudgetRecord::new(
            bk.clone(),
            Caps::new().cost_micros(1_000),
        ))
        .unwrap();
        for k in [&a, &b] {
            s.put_run(
                RunRecord::new(k.clone(), "agent")
                    .with_caps(Caps::new().cost_micros(600))
                    .with_budget("monthly"),
            )
            .unwrap();
        }
        s.reserve(&a, Hold::new("h1", 10_000).cost_micros(500))
            .unwrap();
        s.reserve(&b, Hold::new("h1", 60_000).cost_micros(300))
            .unwrap();
        s.settle(&b, "h1", cost(250)).unwrap();
        s.reserve(&b, Hold::new("h2", 60_000).cost_micros(200))
            .unwrap();
    }
    let s = open();
    let sp = s.run_spend(&a).unwrap().unwrap();
    assert_eq!(
        (sp.held.cost_micros, sp.holds.len(), sp.holds[0].id.as_str()),
        (500, 1, "h1"),
        "the hold survived the reopen"
    );
    let st = s.get_budget(&bk).unwrap().unwrap();
    assert_eq!(
        (st.spent.cost_micros, st.held.cost_micros, st.holds),
        (250, 700, 2),
        "the budget's spend and holds survived the reopen"
    );
    // It still counts: 250 spent + 700 held + 51 asked passes 1000.
    let e = s
        .reserve(&b, Hold::new("h3", 1_000).cost_micros(51))
        .unwrap_err();
    assert!(
        matches!(
            e,
            StateError::BudgetExceeded {
                spent: 250,
                held: 700,
                asked: 51,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(s.verify().unwrap().is_ok(), "{:?}", s.verify().unwrap());
    let stats = s.stats().unwrap();
    let t = &stats.tenants["acme"];
    assert_eq!((t.budgets, t.holds, t.runs_at_cap), (1, 2, 0));
    // And it expires by the clock after the reopen, too.
    clock.advance(10_000);
    assert_eq!(s.get_budget(&bk).unwrap().unwrap().held.cost_micros, 200);
    s.reserve(&b, Hold::new("h3", 1_000).cost_micros(150))
        .unwrap();
    // b: 250 spent + 200 + 150 held = 600, its own cap: at cap.
    assert_eq!(s.stats().unwrap().tenants["acme"].runs_at_cap, 1);
    // The write that touched the budget removed a's expired hold.
    let holds: Vec<String> = export(&s)
        .into_iter()
        .filter_map(|e| match e {
            Entry::Hold { run, hold } => Some(format!("{}/{}", run.run_id, hold.id)),
            _ => None,
        })
        .collect();
    assert_eq!(holds, ["b/h2", "b/h3"]);
    s.settle(&b, "h2", cost(200)).unwrap();
    drop(s);
    let s = open();
    assert_eq!(s.get_budget(&bk).unwrap().unwrap().spent.cost_micros, 450);
    assert_eq!(s.get_run(&b).unwrap().unwrap().cost_micros, 450);
}

#[test]
fn budgets_and_holds_round_trip_through_export_and_import() {
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let src = MemoryStore::with_options(Options::new().clock(clock.clone()));
    let bk = BudgetKey::new("t1", "pool");
    src.put_budget(BudgetRecord::new(bk.clone(), Caps::new().tokens(900)))
        .unwrap();
    let mut b = src.get_budget(&bk).unwrap().unwrap().record;
    b.caps = Caps::new().tokens(1_000);
    src.put_budget(b).unwrap();
    for i in 0..3 {
        let k = RunKey::new("t1", format!("r{i}"));
        src.put_run(RunRecord::new(k.clone(), "x").with_budget("pool"))
            .unwrap();
        src.reserve(&k, Hold::new("h", 60_000).tokens(100)).unwrap();
        src.patch_run(
            &k,
            StateDelta {
                iterations: 1,
                ..Default::default()
            },
        )
        .unwrap();
    }
    let k = RunKey::new("t2", "capped");
    src.put_run(RunRecord::new(k.clone(), "x").with_caps(Caps::new().iterations(4)))
        .unwrap();
    src.reserve(&k, Hold::new("a", 1).iterations(2)).unwrap();
    src.put_run(RunRecord::new(RunKey::new("t2", "plain"), "x"))
        .unwrap();
    let first = export(&src);
    assert!(first.iter().any(|e| matches!(e, Entry::Budget { .. })));
    assert_eq!(
        first
            .iter()
            .filter(|e| matches!(e, Entry::Hold { .. }))
            .count(),
        4
    );
    let dst = MemoryStore::with_options(Options::new().clock(clock.clone()));
    let n = dst.import(&mut first.clone().into_iter().map(Ok)).unwrap();
    assert_eq!(n as usize, first.len());
    assert_eq!(export(&dst), first, "export → import → export is identical");
    assert!(dst.verify().unwrap().is_ok());
    // And through the JSON lines of the export file.
    let json: Vec<String> = first
        .iter()
        .map(|e| serde_json::to_string(e).unwrap())
        .collect();
    let back: Vec<Entry> = json
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(back, first);
    // The imported budget keeps working: its holds and spend count.
    let st = dst.get_budget(&bk).unwrap().unwrap();
    assert_eq!(
        (st.record.version, st.held.tokens, st.spent.iterations),
        (2, 300, 3)
    );
    // A hold whose run is not in the import is refused, naming it.
    let lone = vec![Ok(Entry::Hold {
        run: RunKey::new("t3", "ghost"),
        hold: agentstate::HoldRecord {
            id: "h".into(),
            amounts: Default::default(),
            created_at: 1,
            expires_at: 2,
        },
    })];
    let e = MemoryStore::new()
        .import(&mut lone.into_iter())
        .unwrap_err();
    assert!(
        matches!(&e, StateError::Invalid { what } if what.contains("ghost")),
        "{e:?}"
    );
}

#[test]
fn a_run_record_of_an_earlier_export_without_caps_still_imports() {
    // An export line written before caps existed has neither `caps` nor
    // `budget`: it reads as a run without caps.
    let line = r#"{"kind":"run","key":{"tenant":"t","run_id":"r"},"version":1,"state":"pending","agent_name":"a","session_id":null,"messages_read":0,"pending_tool_calls":[],"usage":{"input_tokens":0,"output_tokens":0},"cost_micros":0,"iterations":0,"approval":null,"created_at":5,"updated_at":5,"seq":1}"#;
    let e: Entry = serde_json::from_str(line).unwrap();
    let Entry::Run(r) = &e else { panic!() };
    assert!(r.caps.is_none() && r.budget.is_none());
    let s = MemoryStore::new();
    s.import(&mut std::iter::once(Ok(e))).unwrap();
    assert!(s.get_run(&RunKey::new("t", "r")).unwrap().is_some());
}

#[cfg(feature = "async")]
#[test]
fn async_store_mirrors_the_budget_calls() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let s = agentstate::AsyncStore::memory();
        let bk = BudgetKey::new("t", "b");
        s.put_budget(BudgetRecord::new(bk.clone(), Caps::new().cost_micros(10)))
            .await
            .unwrap();
        let k = RunKey::new("t", "r");
        s.put_run(RunRecord::new(k.clone(), "x").with_budget("b"))
            .await
            .unwrap();
        s.reserve(&k, Hold::new("h", 1_000).cost_micros(10))
            .await
            .unwrap();
        assert!(matches!(
            s.reserve(&k, Hold::new("h2", 1_000).cost_micros(1)).await,
            Err(StateError::BudgetExceeded { .. })
        ));
        let st = s.settle(&k, "h", cost(4)).await.unwrap();
        assert_eq!(st.record.cost_micros, 4);
        s.reserve(&k, Hold::new("h3", 1_000).cost_micros(6))
            .await
            .unwrap();
        s.release_hold(&k, "h3").await.unwrap();
        assert_eq!(s.run_spend(&k).await.unwrap().unwrap().spent.cost_micros, 4);
        let page = s
            .list_budgets("t", &agentstate::PageRequest::new(10))
            .await
            .unwrap();
        assert_eq!(page.items().len(), 1);
        assert_eq!(
            s.get_budget(&bk).await.unwrap().unwrap().spent.cost_micros,
            4
        );
    });
}
