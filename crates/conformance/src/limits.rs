//! K — limits: id lengths, record and doc sizes, page limits, batch size,
//! pending tool calls, an injective key encoding, the epoch bound (K1–K7).

use std::collections::BTreeSet;

use super::Factory;
use super::helpers::*;
use agentstate_core::limits::{
    BATCH_OPS_MAX, EPOCH_MAX, ID_BYTES_MAX, PAGE_ITEMS_MAX, PENDING_TOOL_CALLS_MAX,
};
use agentstate_core::{
    Alarm, InstanceKey, PageRequest, PersistenceReason, Result, RunKey, RunRecord, SessionKey,
    SessionRecord, StateDelta, StateError, StateQuery, Tray, TrayKey, TrayOp,
};

/// Ids that break K1: empty, 257 ASCII bytes, and 257 bytes of mostly
/// two-byte characters (129 characters — the limit is bytes, not chars).
fn bad_ids() -> Vec<(&'static str, String)> {
    vec![
        ("an empty id", String::new()),
        ("a 257-byte id", "x".repeat(ID_BYTES_MAX + 1)),
        (
            "a 257-byte UTF-8 id",
            format!("{}x", "é".repeat(ID_BYTES_MAX / 2)),
        ),
    ]
}

/// An id of exactly `ID_BYTES_MAX` bytes: `base`, then `fill` characters,
/// then ASCII to make up an odd remainder.
fn id_of_max_len(base: &str, fill: char) -> String {
    let mut s = base.to_string();
    while s.len() + fill.len_utf8() <= ID_BYTES_MAX {
        s.push(fill);
    }
    while s.len() < ID_BYTES_MAX {
        s.push('x');
    }
    s
}
/// K1: ids (tenant, run, session, ns, id, tray ns and id) are 1..=256
/// bytes of UTF-8: every operation refuses others with `Invalid` naming
/// the id, and changes nothing.
pub fn k1_ids_are_1_to_256_bytes(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("k1");
    let ns = unique("k1ns");
    let sk = SessionKey::new(&t, "s");
    create_session(s, &sk);
    let run = create(
        s,
        RunRecord::new(RunKey::new(&t, "r"), "planner").with_session("s"),
    );
    let i = InstanceKey::new(&ns, "i");
    let good_tray = i.tray("t", "1");
    ok(
        s.write_tray(&good_tray, 1, tray(true, "doc", "env")),
        "K1: tray",
    );
    ok(s.set_alarm(&i, 1, 10), "K1: alarm");
    let snap = || {
        (
            walk_runs(s, &StateQuery::new(&t)),
            get_session(s, &sk),
            tray_state(s, &i),
            due_of(s, 10, &ns, 10),
        )
    };
    let before = snap();
    let tk = |ns: &str, id: &str, tns: &str, tid: &str| TrayKey {
        ns: ns.into(),
        id: id.into(),
        tray_ns: tns.into(),
        tray_id: tid.into(),
    };
    type Case<'a> = (
        String,
        &'static [&'static str],
        Box<dyn Fn() -> Result<()> + 'a>,
    );
    for (what, b) in bad_ids() {
        let b = b.as_str();
        let put = |tns: &str, tid: &str| TrayOp::Put {
            tray_ns: tns.into(),
            tray_id: tid.into(),
            tray: tray(false, "x", "env"),
        };
        let del = |tns: &str, tid: &str| TrayOp::Delete {
            tray_ns: tns.into(),
            tray_id: tid.into(),
        };
        let cases: Vec<Case<'_>> = vec![
            (
                "put_run tenant".into(),
                &["tenant"],
                Box::new(|| {
                    s.put_run(RunRecord::new(RunKey::new(b, "r"), "a"))
                        .map(drop)
                }),
            ),
            (
                "put_run run_id".into(),
                &["run_id", "run id"],
                Box::new(|| s.put_run(RunRecord::new(RunKey::new(&t, b), "a")).map(drop)),
            ),
            (
                "put_run session_id".into(),
                &["session"],
                Box::new(|| {
                    s.put_run(RunRecord::new(RunKey::new(&t, "new"), "a").with_session(b))
                        .map(drop)
                }),
            ),
            (
                "get_run tenant".into(),
                &["tenant"],
                Box::new(|| s.get_run(&RunKey::new(b, "r")).map(drop)),
            ),
            (
                "get_run run_id".into(),
                &["run_id", "run id"],
                Box::new(|| s.get_run(&RunKey::new(&t, b)).map(drop)),
            ),
            (
                "patch_run tenant".into(),
                &["tenant"],
                Box::new(|| {
                    s.patch_run(&RunKey::new(b, "r"), StateDelta::default())
                        .map(drop)
                }),
            ),
            (
                "patch_run run_id".into(),
                &["run_id", "run id"],
                Box::new(|| {
                    s.patch_run(&RunKey::new(&t, b), StateDelta::default())
                        .map(drop)
                }),
            ),
            (
                "list_runs tenant".into(),
                &["tenant"],
                Box::new(|| {
                    s.list_runs(&StateQuery::new(b), &PageRequest::default())
                        .map(drop)
                }),
            ),
            (
                "list_runs session".into(),
                &["session"],
                Box::new(|| {
                    s.list_runs(&StateQuery::new(&t).session(b), &PageRequest::default())
                        .map(drop)
                }),
            ),
            (
                "put_session tenant".into(),
                &["tenant"],
                Box::new(|| {
                    s.put_session(SessionRecord::new(SessionKey::new(b, "s")))
                        .map(drop)
                }),
            ),
            (
                "put_session session_id".into(),
                &["session"],
                Box::new(|| {
                    s.put_session(SessionRecord::new(SessionKey::new(&t, b)))
                        .map(drop)
                }),
            ),
            (
                "get_session tenant".into(),
                &["tenant"],
                Box::new(|| s.get_session(&SessionKey::new(b, "s")).map(drop)),
            ),
            (
                "get_session session_id".into(),
                &["session"],
                Box::new(|| s.get_session(&SessionKey::new(&t, b)).map(drop)),
            ),
            (
                "delete_session tenant".into(),
                &["tenant"],
                Box::new(|| s.delete_session(&SessionKey::new(b, "s"), true).map(drop)),
            ),
            (
                "delete_session session_id".into(),
                &["session"],
                Box::new(|| s.delete_session(&SessionKey::new(&t, b), true).map(drop)),
            ),
            (
                "read_tray ns".into(),
                &["ns"],
                Box::new(|| s.read_tray(&tk(b, "i", "t", "1"), 4).map(drop)),
            ),
            (
                "read_tray id".into(),
                &["id"],
                Box::new(|| s.read_tray(&tk(&ns, b, "t", "1"), 4).map(drop)),
            ),
            (
                "read_tray tray_ns".into(),
                &["tray_ns", "tray ns"],
                Box::new(|| s.read_tray(&tk(&ns, "i", b, "1"), 4).map(drop)),
            ),
            (
                "read_tray tray_id".into(),
                &["tray_id", "tray id"],
                Box::new(|| s.read_tray(&tk(&ns, "i", "t", b), 4).map(drop)),
            ),
            (
                "write_tray ns".into(),
                &["ns"],
                Box::new(|| s.write_tray(&tk(b, "i", "t", "1"), 4, tray(false, "x", "env"))),
            ),
            (
                "write_tray id".into(),
                &["id"],
                Box::new(|| s.write_tray(&tk(&ns, b, "t", "1"), 4, tray(false, "x", "env"))),
            ),
            (
                "write_tray tray_ns".into(),
                &["tray_ns", "tray ns"],
                Box::new(|| s.write_tray(&tk(&ns, "i", b, "1"), 4, tray(false, "x", "env"))),
            ),
            (
                "write_tray tray_id".into(),
                &["tray_id", "tray id"],
                Box::new(|| s.write_tray(&tk(&ns, "i", "t", b), 4, tray(false, "x", "env"))),
            ),
            (
                "delete_tray ns".into(),
                &["ns"],
                Box::new(|| s.delete_tray(&tk(b, "i", "t", "1"), 4).map(drop)),
            ),
            (
                "delete_tray id".into(),
                &["id"],
                Box::new(|| s.delete_tray(&tk(&ns, b, "t", "1"), 4).map(drop)),
            ),
            (
                "delete_tray tray_ns".into(),
                &["tray_ns", "tray ns"],
                Box::new(|| s.delete_tray(&tk(&ns, "i", b, "1"), 4).map(drop)),
            ),
            (
                "delete_tray tray_id".into(),
                &["tray_id", "tray id"],
                Box::new(|| s.delete_tray(&tk(&ns, "i", "t", b), 4).map(drop)),
            ),
            (
                "apply_batch ns".into(),
                &["ns"],
                Box::new(|| s.apply_batch(&InstanceKey::new(b, "i"), 4, vec![put("t", "1")])),
            ),
            (
                "apply_batch id".into(),
                &["id"],
                Box::new(|| s.apply_batch(&InstanceKey::new(&ns, b), 4, vec![put("t", "1")])),
            ),
            (
                "apply_batch put tray_ns".into(),
                &["tray_ns", "tray ns"],
                Box::new(|| s.apply_batch(&i, 4, vec![put("t", "2"), put(b, "1")])),
            ),
            (
                "apply_batch put tray_id".into(),
                &["tray_id", "tray id"],
                Box::new(|| s.apply_batch(&i, 4, vec![put("t", "2"), put("t", b)])),
            ),
            (
                "apply_batch delete tray_ns".into(),
                &["tray_ns", "tray ns"],
                Box::new(|| s.apply_batch(&i, 4, vec![del("t", "1"), del(b, "1")])),
            ),
            (
                "apply_batch delete tray_id".into(),
                &["tray_id", "tray id"],
                Box::new(|| s.apply_batch(&i, 4, vec![del("t", "1"), del("t", b)])),
            ),
            (
                "release ns".into(),
                &["ns"],
                Box::new(|| s.release(&InstanceKey::new(b, "i"), 4)),
            ),
            (
                "release id".into(),
                &["id"],
                Box::new(|| s.release(&InstanceKey::new(&ns, b), 4)),
            ),
            (
                "list_trays ns".into(),
                &["ns"],
                Box::new(|| {
                    s.list_trays(&InstanceKey::new(b, "i"), 4, &PageRequest::new(10))
                        .map(drop)
                }),
            ),
            (
                "list_trays id".into(),
                &["id"],
                Box::new(|| {
                    s.list_trays(&InstanceKey::new(&ns, b), 4, &PageRequest::new(10))
                        .map(drop)
                }),
            ),
            (
                "epoch ns".into(),
                &["ns"],
                Box::new(|| s.epoch(&InstanceKey::new(b, "i")).map(drop)),
            ),
            (
                "epoch id".into(),
                &["id"],
                Box::new(|| s.epoch(&InstanceKey::new(&ns, b)).map(drop)),
            ),
            (
                "set_alarm ns".into(),
                &["ns"],
                Box::new(|| s.set_alarm(&InstanceKey::new(b, "i"), 4, 1)),
            ),
            (
                "set_alarm id".into(),
                &["id"],
                Box::new(|| s.set_alarm(&InstanceKey::new(&ns, b), 4, 1)),
            ),
            (
                "ack_alarm ns".into(),
                &["ns"],
                Box::new(|| s.ack_alarm(&InstanceKey::new(b, "i"), 4, 10).map(drop)),
            ),
            (
                "ack_alarm id".into(),
                &["id"],
                Box::new(|| s.ack_alarm(&InstanceKey::new(&ns, b), 4, 10).map(drop)),
            ),
        ];
        for (call, names, f) in &cases {
            let e = expect_err!(f(), StateError::Invalid { .. }, "K1: {call} with {what}");
            assert_names(&e, names, format_args!("K1: {call} with {what}"));
            assert_eq!(
                snap(),
                before,
                "K1/E6: {call} with {what} was refused but changed the store"
            );
        }
    }
    assert_eq!(
        get(s, &run.key).as_ref(),
        Some(&run),
        "K1: the fixture run is untouched"
    );

    // The longest ids, in ASCII and in two-byte characters, work everywhere.
    for fill in ['x', 'é'] {
        let long = |tag: &str| id_of_max_len(&unique(tag), fill);
        let (lt, lr, ls) = (long("t"), long("r"), long("s"));
        assert_eq!(lt.len(), ID_BYTES_MAX, "K1: fixture");
        let lsk = SessionKey::new(&lt, &ls);
        create_session(s, &lsk);
        let lk = RunKey::new(&lt, &lr);
        create(
            s,
            RunRecord::new(lk.clone(), "planner").with_session(ls.clone()),
        );
        ok(
            s.patch_run(
                &lk,
                StateDelta {
                    iterations: 1,
                    ..Default::default()
                },
            ),
            "K1: patch a 256-byte key",
        );
        assert_eq!(
            must_get(s, &lk).iterations,
            1,
            "K1: a 256-byte key reads back"
        );
        assert_eq!(
            keys(&walk_runs(s, &StateQuery::new(&lt).session(ls.clone()))),
            vec![lk.clone()],
            "K1: 256-byte listing"
        );
        let li = InstanceKey::new(long("ns"), long("id"));
        let ltk = li.tray(long("tns"), long("tid"));
        ok(
            s.write_tray(&ltk, 1, tray(true, "d", "env")),
            "K1: a tray with 256-byte ids",
        );
        assert_eq!(
            read_tray(s, &ltk, 1).map(|t| t.doc),
            Some(b"d".to_vec()),
            "K1: it reads back"
        );
        assert_eq!(tray_state(s, &li).1.len(), 1, "K1: it lists");
        ok(s.set_alarm(&li, 1, 5), "K1: an alarm with 256-byte ids");
        assert_eq!(
            due_of(s, 5, &li.ns, 10),
            vec![alarm(&li, 5)],
            "K1: it is due"
        );
        ok(
            s.delete_session(&lsk, true),
            "K1: cascade a 256-byte session",
        );
    }
}

/// K2: a record or tray doc past 1 MiB is `Persistence { reason: TooLarge }`
/// and nothing is written; below it, it is stored.
pub fn k2_records_and_docs_past_limit_too_large(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("k2");
    let args = |bytes: usize| format!(r#"{{"blob":"{}"}}"#, "x".repeat(bytes));
    macro_rules! too_large {
        ($call:expr, $($ctx:tt)+) => {{
            let e = expect_err!($call, StateError::Persistence { reason: PersistenceReason::TooLarge, .. }, $($ctx)+);
            assert!(!e.is_retryable(), "K2/E3: TooLarge is not retryable");
        }};
    }
    let key = RunKey::new(&t, "big");
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = vec![tool_call("c", &args(1_150_000))];
    too_large!(
        s.put_run(rec),
        "K2: creating a run with 1.1 MiB of tool-call arguments"
    );
    assert_eq!(get(s, &key), None, "K2/E6: the refused run exists");
    assert!(
        walk_runs(s, &StateQuery::new(&t)).is_empty(),
        "K2/E6: the refused run is listed"
    );

    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = vec![tool_call("c", &args(900_000))];
    let stored = create(s, rec);
    assert_eq!(
        stored.pending_tool_calls[0].arguments.len(),
        args(900_000).len(),
        "K2: a 900 KB run is stored whole"
    );
    let mut grown = stored.clone();
    grown
        .pending_tool_calls
        .push(tool_call("d", &args(250_000)));
    too_large!(s.put_run(grown), "K2: growing a run past 1 MiB");
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&stored),
        "K2/E6: the refused update changed the run"
    );

    let sk = SessionKey::new(&t, "big");
    let mut srec = SessionRecord::new(sk.clone());
    srec.metadata.insert("blob".into(), "x".repeat(1_150_000));
    too_large!(s.put_session(srec), "K2: a 1.1 MiB session");
    assert_eq!(
        get_session(s, &sk),
        None,
        "K2/E6: the refused session exists"
    );

    let ns = unique("k2ns");
    let i = InstanceKey::new(&ns, "i");
    let k = i.tray("t", "big");
    ok(
        s.write_tray(&k, 1, tray(false, "small", "env")),
        "K2: a small tray",
    );
    let over = tray(true, vec![0xAB; (1 << 20) + 1], "env");
    too_large!(
        s.write_tray(&k, 3, over.clone()),
        "K2: a tray doc of 1 MiB + 1 byte"
    );
    too_large!(
        s.apply_batch(
            &i,
            3,
            vec![TrayOp::Put {
                tray_ns: "t".into(),
                tray_id: "big".into(),
                tray: over
            }]
        ),
        "K2: a batch with a tray doc of 1 MiB + 1 byte"
    );
    assert_eq!(
        read_tray(s, &k, 1).map(|t| t.doc),
        Some(b"small".to_vec()),
        "K2/E6: a refused tray was written"
    );
    assert_eq!(
        epoch_of(s, &i),
        1,
        "K2/E6: a refused tray write moved the epoch"
    );
    assert!(
        marked_of(s, None, &ns, 1000).is_empty(),
        "K2/E6: a refused tray was marked"
    );
    let under = tray(false, vec![0xCD; (1 << 20) - 4096], "env");
    ok(
        s.write_tray(&k, 1, under.clone()),
        "K2: a tray doc just under 1 MiB",
    );
    assert_eq!(
        read_tray(s, &k, 1).as_ref(),
        Some(&under),
        "K2: a doc just under 1 MiB is stored whole"
    );
}

/// K3: a page is 1..=1000 items; 0 and 1,001 are `Invalid` on every
/// listing.
pub fn k3_page_limit_1_to_1000(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("k3");
    let ns = unique("k3ns");
    let env = unique("k3env");
    let i = InstanceKey::new(&ns, "i");
    create(s, RunRecord::new(RunKey::new(&t, "r"), "planner"));
    ok(
        s.write_tray(&i.tray("t", "1"), 1, tray(true, "d", &env)),
        "K3: tray",
    );
    ok(s.set_alarm(&i, 1, 5), "K3: alarm");
    for limit in [0, PAGE_ITEMS_MAX + 1, usize::MAX] {
        let ctx = |call: &str| format!("K3: {call} with limit {limit}");
        let e = expect_err!(
            s.list_runs(&StateQuery::new(&t), &PageRequest::new(limit)),
            StateError::Invalid { .. },
            "{}",
            ctx("list_runs")
        );
        assert_names(&e, &["limit"], ctx("list_runs"));
        let e = expect_err!(
            s.list_trays(&i, 2, &PageRequest::new(limit)),
            StateError::Invalid { .. },
            "{}",
            ctx("list_trays")
        );
        assert_names(&e, &["limit"], ctx("list_trays"));
        assert_eq!(
            epoch_of(s, &i),
            1,
            "K3/E6: a refused list_trays moved the epoch"
        );
        let e = expect_err!(
            s.marked_trays(None, &PageRequest::new(limit)),
            StateError::Invalid { .. },
            "{}",
            ctx("marked_trays(None)")
        );
        assert_names(&e, &["limit"], ctx("marked_trays(None)"));
        let e = expect_err!(
            s.marked_trays(Some(&env), &PageRequest::new(limit)),
            StateError::Invalid { .. },
            "{}",
            ctx("marked_trays(env)")
        );
        assert_names(&e, &["limit"], ctx("marked_trays(env)"));
        let e = expect_err!(
            s.due_alarms(5, &PageRequest::new(limit)),
            StateError::Invalid { .. },
            "{}",
            ctx("due_alarms")
        );
        assert_names(&e, &["limit"], ctx("due_alarms"));
    }
    for limit in [1, PAGE_ITEMS_MAX] {
        assert_eq!(
            ok(
                s.list_runs(&StateQuery::new(&t), &PageRequest::new(limit)),
                "K3: list_runs"
            )
            .items()
            .len(),
            1,
            "K3: limit {limit}"
        );
        assert_eq!(
            ok(
                s.list_trays(&i, 1, &PageRequest::new(limit)),
                "K3: list_trays"
            )
            .items()
            .len(),
            1,
            "K3: limit {limit}"
        );
        assert_eq!(
            ok(
                s.marked_trays(Some(&env), &PageRequest::new(limit)),
                "K3: marked_trays"
            )
            .items()
            .len(),
            1,
            "K3: limit {limit}"
        );
        assert!(
            ok(
                s.marked_trays(None, &PageRequest::new(limit)),
                "K3: marked_trays(None)"
            )
            .items()
            .len()
                <= limit,
            "K3: limit {limit}"
        );
        assert!(
            ok(s.due_alarms(5, &PageRequest::new(limit)), "K3: due_alarms")
                .items()
                .len()
                <= limit,
            "K3: limit {limit}"
        );
    }
}

/// K4: a tray batch holds at most 10,000 ops: 10,001 is `Invalid` and
/// applies nothing; 10,000 applies whole.
pub fn k4_batch_at_most_10000_ops(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("k4");
    let i = InstanceKey::new(&ns, "i");
    ok(
        s.write_tray(&i.tray("keep", "1"), 1, tray(false, "keep", "env")),
        "K4: fixture",
    );
    let ops = |n: usize| -> Vec<TrayOp> {
        (0..n)
            .map(|k| TrayOp::Put {
                tray_ns: "b".into(),
                tray_id: format!("{k:05}"),
                tray: tray(false, "d", "env"),
            })
            .collect()
    };
    let before = tray_state(s, &i);
    let e = expect_err!(
        s.apply_batch(&i, 2, ops(BATCH_OPS_MAX + 1)),
        StateError::Invalid { .. },
        "K4: a batch of 10,001 ops"
    );
    assert_names(&e, &["batch", "ops"], "K4: a batch of 10,001 ops");
    assert_eq!(
        tray_state(s, &i),
        before,
        "K4/E6: a refused batch applied something or moved the epoch"
    );
    let mut deletes: Vec<TrayOp> = (0..BATCH_OPS_MAX)
        .map(|k| TrayOp::Delete {
            tray_ns: "b".into(),
            tray_id: k.to_string(),
        })
        .collect();
    deletes.push(TrayOp::Delete {
        tray_ns: "keep".into(),
        tray_id: "1".into(),
    });
    expect_err!(
        s.apply_batch(&i, 2, deletes),
        StateError::Invalid { .. },
        "K4: a batch of 10,001 deletes"
    );
    assert_eq!(
        tray_state(s, &i),
        before,
        "K4/E6: a refused batch of deletes applied something"
    );

    ok(
        s.apply_batch(&i, 2, ops(BATCH_OPS_MAX)),
        "K4: a batch of 10,000 ops",
    );
    let (e, trays) = tray_state(s, &i);
    assert_eq!(e, 2, "K4: the batch ran at its epoch");
    assert_eq!(
        trays.len(),
        BATCH_OPS_MAX + 1,
        "K4: all 10,000 writes applied"
    );
}

/// K5: a run holds at most 1,024 pending tool calls: 1,025 is `Invalid`
/// (create and update), 1,024 is stored.
pub fn k5_at_most_1024_pending_tool_calls(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("k5");
    let calls = |n: usize| {
        (0..n)
            .map(|k| tool_call(&format!("call-{k}"), r#"{"q":1}"#))
            .collect::<Vec<_>>()
    };
    let key = RunKey::new(&t, "run");
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = calls(PENDING_TOOL_CALLS_MAX + 1);
    let e = expect_err!(
        s.put_run(rec),
        StateError::Invalid { .. },
        "K5: creating a run with 1,025 pending calls"
    );
    assert_names(
        &e,
        &["pending_tool_calls", "tool calls"],
        "K5: 1,025 pending calls",
    );
    assert_eq!(get(s, &key), None, "K5/E6: the refused run exists");

    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = calls(PENDING_TOOL_CALLS_MAX);
    let stored = create(s, rec);
    assert_eq!(
        stored.pending_tool_calls.len(),
        1024,
        "K5: 1,024 pending calls are stored"
    );
    assert_eq!(
        must_get(s, &key).pending_tool_calls,
        calls(1024),
        "K5: in order"
    );
    assert!(stored.mid_tool_call(), "K5: mid tool call");
    let mut more = stored.clone();
    more.pending_tool_calls.push(tool_call("one-more", "{}"));
    let e = expect_err!(
        s.put_run(more),
        StateError::Invalid { .. },
        "K5: growing a run to 1,025 pending calls"
    );
    assert_names(
        &e,
        &["pending_tool_calls", "tool calls"],
        "K5: 1,025 pending calls",
    );
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&stored),
        "K5/E6: the refused update changed the run"
    );
}

/// Pieces of keys that a naive encoding would confuse: separators, NUL
/// bytes, a byte-1 terminator look-alike, prefixes of each other.
const K6_PIECES: [&str; 11] = [
    "a", "a/b", "b", "b/c", "c", "a\0", "\0b", "a\0b", "\0", "a\u{1}", "\u{1}b",
];

/// K6: the key encoding is injective — tenant "a" + run "b/c" and tenant
/// "a/b" + run "c", ids differing by a separator or a NUL byte, "a\0" and
/// "a": distinct records that never read each other; for runs, sessions,
/// trays, epochs, alarms and the listings.
pub fn k6_key_encoding_injective(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let p = unique("k6");
    let tenant = |x: &str| format!("{p}{x}");

    // Runs: every tenant piece × every run piece.
    let mut recs = Vec::new();
    for (ti, tp) in K6_PIECES.iter().enumerate() {
        for (ri, rp) in K6_PIECES.iter().enumerate() {
            recs.push(RunRecord::new(
                RunKey::new(tenant(tp), *rp),
                format!("k6-{ti}-{ri}"),
            ));
        }
    }
    create_many(s, recs.clone());
    let twin = RunKey::new(tenant("a"), "b/c");
    ok(
        s.patch_run(
            &twin,
            StateDelta {
                iterations: 7,
                ..Default::default()
            },
        ),
        "K6: patch one of a pair",
    );
    for r in &recs {
        let got = must_get(s, &r.key);
        assert_eq!(
            got.agent_name, r.agent_name,
            "K6: {:?} read another run's record",
            r.key
        );
        let want_iter = if r.key == twin { 7 } else { 0 };
        assert_eq!(
            got.iterations, want_iter,
            "K6: patching {twin:?} reached {:?}",
            r.key
        );
    }
    for tp in K6_PIECES {
        let want: BTreeSet<String> = K6_PIECES.iter().map(|x| x.to_string()).collect();
        let got: BTreeSet<String> = walk_runs(s, &StateQuery::new(tenant(tp)))
            .into_iter()
            .map(|r| r.key.run_id)
            .collect();
        assert_eq!(
            got,
            want,
            "K6: tenant {:?} lists exactly its own runs",
            tenant(tp)
        );
    }

    // Sessions, and runs listed by session.
    let mut sessions = Vec::new();
    for tp in K6_PIECES {
        for sp in K6_PIECES {
            sessions.push(SessionKey::new(tenant(tp), sp));
        }
    }
    par_map(&sessions, |k| {
        let mut r = SessionRecord::new(k.clone());
        r.metadata
            .insert("who".into(), format!("{:?}", (&k.tenant, &k.session_id)));
        ok(s.put_session(r), "K6: session");
        let run = RunRecord::new(
            RunKey::new(k.tenant.clone(), format!("in-{:?}", k.session_id)),
            "planner",
        )
        .with_session(k.session_id.clone());
        create(s, run);
    });
    for k in &sessions {
        let got = get_session(s, k).expect("K6: session exists");
        assert_eq!(
            got.metadata["who"],
            format!("{:?}", (&k.tenant, &k.session_id)),
            "K6: {k:?} read another session"
        );
        let listed: Vec<String> = walk_runs(
            s,
            &StateQuery::new(k.tenant.clone()).session(k.session_id.clone()),
        )
        .into_iter()
        .map(|r| r.key.run_id)
        .collect();
        assert_eq!(
            listed,
            vec![format!("in-{:?}", k.session_id)],
            "K6: session {k:?} lists exactly its own run"
        );
    }
    let gone = SessionKey::new(tenant("a"), "b/c");
    let deleted = ok(s.delete_session(&gone, true), "K6: cascade one of a pair");
    assert_eq!(
        deleted.len(),
        1,
        "K6: a cascade reached another session's runs: {deleted:?}"
    );
    for k in sessions.iter().filter(|k| **k != gone) {
        assert!(
            get_session(s, k).is_some(),
            "K6: deleting {gone:?} deleted {k:?}"
        );
    }

    // Trays: every (ns, id, tray ns, tray id) from a smaller set of pieces.
    let pieces = ["a", "a/b", "b", "\0", "a\0", "\u{1}b"];
    let instances: Vec<InstanceKey> = pieces
        .iter()
        .flat_map(|n| pieces.iter().map(move |i| InstanceKey::new(tenant(n), *i)))
        .collect();
    let doc =
        |i: &InstanceKey, tn: &str, ti: &str| format!("{:?}", (&i.ns, &i.id, tn, ti)).into_bytes();
    let env_of = |tn: &str| format!("{p}{tn}");
    par_map(
        &instances.iter().enumerate().collect::<Vec<_>>(),
        |(n, i)| {
            let ops = pieces
                .iter()
                .flat_map(|tn| pieces.iter().map(move |ti| (*tn, *ti)))
                .map(|(tn, ti)| TrayOp::Put {
                    tray_ns: tn.into(),
                    tray_id: ti.into(),
                    tray: Tray {
                        marked: ti == "a",
                        doc: doc(i, tn, ti),
                        env: env_of(tn),
                        hostname: "h".into(),
                    },
                })
                .collect();
            ok(s.apply_batch(i, *n as u64 + 1, ops), "K6: trays");
            ok(
                s.set_alarm(i, *n as u64 + 1, 1_000 + *n as u64),
                "K6: alarm",
            );
        },
    );
    for (n, i) in instances.iter().enumerate() {
        assert_eq!(
            epoch_of(s, i),
            n as u64 + 1,
            "K6: {i:?} read another instance's epoch"
        );
        let (_, trays) = tray_state(s, i);
        assert_eq!(
            trays.len(),
            pieces.len() * pieces.len(),
            "K6: {i:?} lists exactly its own trays"
        );
        for (k, t) in &trays {
            assert_eq!(
                k.instance(),
                *i,
                "K6: {i:?} listed another instance's tray {k:?}"
            );
            assert_eq!(
                t.doc,
                doc(i, &k.tray_ns, &k.tray_id),
                "K6: {k:?} holds another tray's doc"
            );
        }
        let k = i.tray("a", "a/b");
        assert_eq!(
            read_tray(s, &k, n as u64 + 1).map(|t| t.doc),
            Some(doc(i, "a", "a/b")),
            "K6: {k:?} reads its own doc"
        );
    }
    for tn in pieces {
        let env = env_of(tn);
        let got: BTreeSet<TrayKey> = marked_of(s, Some(&env), &p, 1000)
            .into_iter()
            .map(|m| m.key)
            .collect();
        let want: BTreeSet<TrayKey> = instances.iter().map(|i| i.tray(tn, "a")).collect();
        assert_eq!(
            got, want,
            "K6: env {env:?} lists exactly its own marked trays"
        );
    }
    let due = due_of(s, 1_000 + instances.len() as u64, &p, 1000);
    let want: Vec<Alarm> = instances
        .iter()
        .enumerate()
        .map(|(n, i)| alarm(i, 1_000 + n as u64))
        .collect();
    assert_eq!(due, want, "K6: every instance has exactly its own alarm");
}

/// K7: every epoch a tray call carries is at most `EPOCH_MAX` (`i64::MAX`,
/// the seeds' `bigint` epoch column). Past it every tray and alarm call
/// (reads, writes, deletes, batches keyed or not, release, `list_trays`
/// and `instance_trays`, set and ack of the alarm) is `Invalid` naming the epoch and
/// the bound, and nothing changes: no tray, no alarm, no mark, and the
/// fence does not advance — neither on a new instance nor past a stored
/// `EPOCH_MAX`.
pub fn k7_epochs_at_most_epoch_max(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("k7");
    let env = unique("k7env");
    let i = InstanceKey::new(&ns, "i");
    let fresh = InstanceKey::new(&ns, "fresh");
    let k = i.tray("t", "1");
    let idem = ok(
        agentstate_core::IdempotencyKey::new(unique("k7key")),
        "K7: a key",
    );
    type Call<'a> = (
        &'static str,
        Box<dyn Fn(&InstanceKey, u64) -> Result<()> + 'a>,
    );
    let calls: Vec<Call<'_>> = vec![
        (
            "read_tray",
            Box::new(|i, e| s.read_tray(&i.tray("t", "1"), e).map(|_| ())),
        ),
        (
            "write_tray",
            Box::new(|i, e| s.write_tray(&i.tray("t", "2"), e, tray(true, "w", &env))),
        ),
        (
            "delete_tray",
            Box::new(|i, e| s.delete_tray(&i.tray("t", "1"), e).map(|_| ())),
        ),
        (
            "apply_batch",
            Box::new(|i, e| {
                s.apply_batch(
                    i,
                    e,
                    vec![TrayOp::Delete {
                        tray_ns: "t".into(),
                        tray_id: "1".into(),
                    }],
                )
            }),
        ),
        (
            "an empty batch",
            Box::new(|i, e| s.apply_batch(i, e, Vec::new())),
        ),
        (
            "apply_batch_idempotent",
            Box::new(|i, e| {
                s.apply_batch_idempotent(
                    i,
                    e,
                    vec![TrayOp::Put {
                        tray_ns: "t".into(),
                        tray_id: "3".into(),
                        tray: tray(true, "k", &env),
                    }],
                    &idem,
                )
            }),
        ),
        ("release", Box::new(|i, e| s.release(i, e))),
        (
            "list_trays",
            Box::new(|i, e| s.list_trays(i, e, &PageRequest::new(10)).map(|_| ())),
        ),
        (
            "instance_trays",
            Box::new(|i, e| {
                s.instance_trays(i, e, &agentstate_core::TrayFilter::new().marked(true))
                    .map(|_| ())
            }),
        ),
        ("set_alarm", Box::new(|i, e| s.set_alarm(i, e, 50))),
        (
            "ack_alarm",
            Box::new(|i, e| s.ack_alarm(i, e, 100).map(|_| ())),
        ),
    ];
    // An instance with a marked tray and an alarm, at epoch 5.
    ok(
        s.write_tray(&k, 5, tray(true, "doc", &env)),
        "K7: fixture tray",
    );
    ok(s.set_alarm(&i, 5, 100), "K7: fixture alarm");
    let state = |inst: &InstanceKey| {
        (
            tray_state(s, inst),
            due_of(s, 1_000, &ns, 100),
            marked_of(s, Some(&env), &ns, 100),
        )
    };
    let over = |inst: &InstanceKey, stage: &str| {
        let before = state(inst);
        for (what, call) in &calls {
            for e in [EPOCH_MAX + 1, EPOCH_MAX + 2, u64::MAX - 1, u64::MAX] {
                let err = expect_err!(
                    call(inst, e),
                    StateError::Invalid { .. },
                    "K7: {what} at epoch {e} ({stage})"
                );
                assert_names(&err, &["epoch"], format_args!("K7: {what} at epoch {e}"));
                assert!(
                    err.to_string().contains(&EPOCH_MAX.to_string()),
                    "K7: {what} at epoch {e}: the error must name the bound {EPOCH_MAX}, got {err}"
                );
                assert_eq!(
                    state(inst),
                    before,
                    "K7/E6: {what} at epoch {e} ({stage}) changed the instance or moved its epoch"
                );
            }
        }
    };
    over(&i, "stored epoch 5");
    assert_eq!(epoch_of(s, &i), 5, "K7: the fence did not advance");
    // A new instance gets no epoch from a refused call.
    over(&fresh, "a new instance");
    assert_eq!(epoch_of(s, &fresh), 0, "K7: a new instance keeps epoch 0");

    // At the bound every call runs and stores it.
    for (what, call) in &calls {
        ok(call(&i, EPOCH_MAX), format_args!("K7: {what} at EPOCH_MAX"));
        assert_eq!(
            epoch_of(s, &i),
            EPOCH_MAX,
            "K7: {what} at EPOCH_MAX stores it"
        );
    }
    // Past a stored EPOCH_MAX: still `Invalid`, never a fence past it.
    over(&i, "stored EPOCH_MAX");
    assert_eq!(
        epoch_of(s, &i),
        EPOCH_MAX,
        "K7: the fence stays at EPOCH_MAX"
    );
    expect_err!(
        s.write_tray(&k, EPOCH_MAX - 1, tray(false, "x", &env)),
        StateError::FenceLost { caller, stored: EPOCH_MAX, .. } if caller == EPOCH_MAX - 1,
        "K7: below a stored EPOCH_MAX"
    );
}
