//! I — idempotency keys: a keyed write applies at most once, and a repeat
//! answers the first outcome.

use std::sync::Barrier;

use super::Factory;
use super::helpers::*;
use agentstate_core::{
    BudgetKey, BudgetRecord, Caps, Hold, IdempotencyKey, InstanceKey, RecordKey, RunKey, RunRecord,
    StateDelta, StateError, TrayOp, Usage,
};

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new(k).expect("a key of 1..=128 bytes")
}

fn spend(cost: u64) -> StateDelta {
    StateDelta {
        usage: Usage {
            input_tokens: cost,
            output_tokens: 1,
        },
        cost_micros: cost,
        iterations: 1,
        messages_read: 1,
    }
}

/// I1: every keyed write (`put_run`, `patch_run`, `reserve`, `settle`,
/// `release_hold`, `apply_batch`) applies once; each repeat with the same
/// key and arguments answers what the first call answered and writes
/// nothing, however often it comes.
pub fn i1_keyed_writes_apply_once_and_repeats_answer_the_first_outcome(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("i1");
    let rk = RunKey::new(&t, "r");
    let created = ok(
        s.put_run_idempotent(
            RunRecord::new(rk.clone(), "planner").with_caps(Caps::new().cost_micros(1_000)),
            &key("create"),
        ),
        "I1: keyed create",
    );
    let patched = ok(
        s.patch_run_idempotent(&rk, spend(7), &key("patch")),
        "I1: keyed patch",
    );
    let hold = ok(
        s.reserve_idempotent(
            &rk,
            Hold::new("h1", 60_000).cost_micros(100),
            &key("reserve"),
        ),
        "I1: keyed reserve",
    );
    ok(
        s.reserve_idempotent(
            &rk,
            Hold::new("h2", 60_000).cost_micros(50),
            &key("reserve2"),
        ),
        "I1: a second keyed reserve",
    );
    let settled = ok(
        s.settle_idempotent(&rk, "h1", spend(90), &key("settle")),
        "I1: keyed settle",
    );
    ok(
        s.release_hold_idempotent(&rk, "h2", &key("release")),
        "I1: keyed release",
    );
    let inst = InstanceKey::new(unique("i1ns"), "w");
    let ops = vec![TrayOp::Put {
        tray_ns: "state".into(),
        tray_id: "main".into(),
        tray: tray(true, b"one".to_vec(), "prod"),
    }];
    ok(
        s.apply_batch_idempotent(&inst, 1, ops.clone(), &key("batch")),
        "I1: keyed batch",
    );
    let after = must_get(s, &rk);
    assert_eq!(
        (after.cost_micros, after.iterations, after.version),
        (97, 2, 3),
        "I1: the first calls applied once each"
    );
    // Another writer moves the tray on; a repeat of the batch must not
    // write it back.
    ok(
        s.write_tray(
            &inst.tray("state", "main"),
            1,
            tray(false, b"two".to_vec(), "prod"),
        ),
        "I1: a later tray write",
    );
    for round in 0..3 {
        let ctx = format_args!("I1: repeat {round}");
        let again = ok(
            s.put_run_idempotent(
                RunRecord::new(rk.clone(), "planner").with_caps(Caps::new().cost_micros(1_000)),
                &key("create"),
            ),
            ctx,
        );
        assert_eq!(
            again, created,
            "{ctx}: a repeated create answers the created record"
        );
        let again = ok(s.patch_run_idempotent(&rk, spend(7), &key("patch")), ctx);
        assert_eq!(
            again, patched,
            "{ctx}: a repeated patch answers the first record"
        );
        let again = ok(
            s.reserve_idempotent(
                &rk,
                Hold::new("h1", 60_000).cost_micros(100),
                &key("reserve"),
            ),
            ctx,
        );
        assert_eq!(
            again, hold,
            "{ctx}: a repeated reserve answers the first hold"
        );
        let again = ok(
            s.settle_idempotent(&rk, "h1", spend(90), &key("settle")),
            ctx,
        );
        assert_eq!(
            again, settled,
            "{ctx}: a repeated settle answers the first Settled"
        );
        ok(s.release_hold_idempotent(&rk, "h2", &key("release")), ctx);
        ok(
            s.apply_batch_idempotent(&inst, 1, ops.clone(), &key("batch")),
            ctx,
        );
    }
    assert_eq!(
        must_get(s, &rk),
        after,
        "I1: the repeats changed nothing of the run"
    );
    let spend_now = ok(s.run_spend(&rk), "I1: run_spend").expect("the run exists");
    assert!(
        spend_now.holds.is_empty(),
        "I1: no hold was reserved again: {:?}",
        spend_now.holds
    );
    assert_eq!(
        read_tray(s, &inst.tray("state", "main"), 1).map(|t| t.doc),
        Some(b"two".to_vec()),
        "I1: a repeated batch wrote nothing"
    );
    // Without keys the same calls apply again: the keys did the work.
    ok(s.patch_run(&rk, spend(7)), "I1: an unkeyed patch");
    assert_eq!(must_get(s, &rk).cost_micros, 104);
}

/// I2: a keyed `put_run` that landed, repeated, answers the stored record,
/// never a `Conflict` against itself, even after later writes moved the
/// run on; a keyed call that was refused answers the same refusal again.
pub fn i2_a_repeated_put_answers_its_own_write_not_a_conflict(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("i2");
    let rk = RunKey::new(&t, "r");
    let v1 = create(s, RunRecord::new(rk.clone(), "planner"));
    let mut next = v1.clone();
    next.state = agentstate_core::RunState::Running;
    let v2 = ok(
        s.put_run_idempotent(next.clone(), &key("u1")),
        "I2: keyed update",
    );
    assert_eq!(v2.version, 2);
    ok(s.patch_run(&rk, spend(1)), "I2: a later patch");
    let again = ok(
        s.put_run_idempotent(next.clone(), &key("u1")),
        "I2: the update repeated after the run moved on",
    );
    assert_eq!(
        again, v2,
        "I2: the repeat answers the record the update stored"
    );
    // Without the key the same put is a Conflict.
    expect_err!(
        s.put_run(next.clone()),
        StateError::Conflict {
            expected: 1,
            actual: 3,
            ..
        },
        "I2: the unkeyed put of the same record"
    );
    // A refusal is remembered: its repeat answers the same Conflict, with
    // the versions of its moment, whatever the run holds now.
    let stale = v1.clone();
    expect_err!(
        s.put_run_idempotent(stale.clone(), &key("stale")),
        StateError::Conflict {
            ref record,
            expected: 1,
            actual: 3,
        } if *record == RecordKey::Run(rk.clone()),
        "I2: a keyed stale put"
    );
    ok(s.patch_run(&rk, spend(1)), "I2: another patch");
    expect_err!(
        s.put_run_idempotent(stale, &key("stale")),
        StateError::Conflict {
            ref record,
            expected: 1,
            actual: 3,
        } if *record == RecordKey::Run(rk.clone()),
        "I2: the repeat of a refused put answers the first refusal, naming its run"
    );
    // A keyed patch of a missing run is NotFound, and stays so for its key
    // once the run exists.
    let missing = RunKey::new(&t, "later");
    expect_err!(
        s.patch_run_idempotent(&missing, spend(5), &key("early")),
        StateError::NotFound(_),
        "I2: a keyed patch of a missing run"
    );
    create(s, RunRecord::new(missing.clone(), "planner"));
    expect_err!(
        s.patch_run_idempotent(&missing, spend(5), &key("early")),
        StateError::NotFound(_),
        "I2: its repeat after the run was created"
    );
    assert_eq!(
        must_get(s, &missing).cost_micros,
        0,
        "I2: nothing was added"
    );
    // A keyed batch below the stored epoch is FenceLost naming its
    // instance, and so is its repeat after the epoch moved on again.
    let inst = InstanceKey::new(unique("i2ns"), "w");
    let put = vec![TrayOp::Put {
        tray_ns: "state".into(),
        tray_id: "main".into(),
        tray: tray(false, b"x".to_vec(), "prod"),
    }];
    ok(
        s.apply_batch(&inst, 2, put.clone()),
        "I2: a batch at epoch 2",
    );
    for round in ["first", "repeat"] {
        expect_err!(
            s.apply_batch_idempotent(&inst, 1, put.clone(), &key("fenced")),
            StateError::FenceLost {
                ref instance,
                caller: 1,
                stored: 2,
            } if *instance == inst,
            "I2: a keyed batch at epoch 1 ({round})"
        );
        ok(
            s.apply_batch(&inst, 3, put.clone()),
            "I2: the epoch moves to 3",
        );
    }
}

/// I3: a key used again with other arguments, or for another operation, is
/// `Invalid` naming the key, and changes nothing; a key is 1..=128 bytes.
pub fn i3_a_key_reused_for_other_arguments_is_invalid(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("i3");
    let rk = RunKey::new(&t, "r");
    create(s, RunRecord::new(rk.clone(), "planner"));
    ok(
        s.patch_run_idempotent(&rk, spend(3), &key("k")),
        "I3: first use",
    );
    let before = must_get(s, &rk);
    let e = expect_err!(
        s.patch_run_idempotent(&rk, spend(4), &key("k")),
        StateError::Invalid { .. },
        "I3: the key with another delta"
    );
    assert_names(&e, &["idempotency key"], "I3");
    expect_err!(
        s.patch_run_idempotent(&RunKey::new(&t, "other"), spend(3), &key("k")),
        StateError::Invalid { .. },
        "I3: the key with another run"
    );
    expect_err!(
        s.reserve_idempotent(&rk, Hold::new("h", 60_000).tokens(1), &key("k")),
        StateError::Invalid { .. },
        "I3: the key for another operation"
    );
    assert_eq!(must_get(s, &rk), before, "I3: nothing changed");
    let spend_now = ok(s.run_spend(&rk), "I3: run_spend").expect("exists");
    assert!(spend_now.holds.is_empty(), "I3: no hold was made");
    assert!(IdempotencyKey::new("").is_err(), "I3: an empty key");
    assert!(
        IdempotencyKey::new("k".repeat(129)).is_err(),
        "I3: 129 bytes"
    );
    let long = key(&"k".repeat(128));
    ok(
        s.patch_run_idempotent(&rk, spend(1), &long),
        "I3: a 128-byte key",
    );
}

/// I4: keys are scoped: the same key in two tenants (trays: two instance
/// namespaces) names two operations, each applied once.
pub fn i4_keys_are_scoped_by_tenant_and_namespace(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let (ta, tb) = (unique("i4a"), unique("i4b"));
    for t in [&ta, &tb] {
        let rk = RunKey::new(t, "r");
        create(s, RunRecord::new(rk.clone(), "planner"));
        ok(
            s.patch_run_idempotent(&rk, spend(5), &key("shared")),
            "I4: the key in each tenant",
        );
        assert_eq!(must_get(s, &rk).cost_micros, 5, "I4: applied in {t}");
    }
    let (na, nb) = (unique("i4na"), unique("i4nb"));
    for ns in [&na, &nb] {
        let inst = InstanceKey::new(ns, "w");
        ok(
            s.apply_batch_idempotent(
                &inst,
                1,
                vec![TrayOp::Put {
                    tray_ns: "s".into(),
                    tray_id: "m".into(),
                    tray: tray(false, ns.as_bytes().to_vec(), "prod"),
                }],
                &key("shared"),
            ),
            "I4: the key in each namespace",
        );
        assert_eq!(
            read_tray(s, &inst.tray("s", "m"), 1).map(|t| t.doc),
            Some(ns.as_bytes().to_vec()),
            "I4: applied in {ns}"
        );
    }
}

/// I5: a key is kept for the store's window (by default 24 hours of its
/// clock): a repeat within it applies nothing; once the window has passed
/// and later keyed writes of the tenant have pruned it, the key is
/// forgotten and a repeat applies again (so callers keep retries within
/// the window).
pub fn i5_keys_are_kept_for_the_window_then_forgotten(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("i5");
    let rk = RunKey::new(&t, "r");
    create(s, RunRecord::new(rk.clone(), "planner"));
    ok(
        s.patch_run_idempotent(&rk, spend(2), &key("old")),
        "I5: first",
    );
    c.clock
        .advance(agentstate_core::limits::IDEMPOTENCY_TTL_MILLIS_DEFAULT - 1);
    ok(
        s.patch_run_idempotent(&rk, spend(3), &key("new")),
        "I5: a later keyed write",
    );
    ok(
        s.patch_run_idempotent(&rk, spend(2), &key("old")),
        "I5: the repeat within the window",
    );
    assert_eq!(
        must_get(s, &rk).cost_micros,
        5,
        "I5: kept within the window"
    );
    c.clock.advance(2);
    ok(
        s.patch_run_idempotent(&rk, spend(1), &key("pruner")),
        "I5: a keyed write past the first key's window",
    );
    ok(
        s.patch_run_idempotent(&rk, spend(2), &key("old")),
        "I5: the repeat past the window",
    );
    assert_eq!(
        must_get(s, &rk).cost_micros,
        8,
        "I5: a key past its window is forgotten and applies again"
    );
    ok(
        s.patch_run_idempotent(&rk, spend(3), &key("new")),
        "I5: the second key, still within its window",
    );
    assert_eq!(must_get(s, &rk).cost_micros, 8, "I5: still kept");
}

/// I6: calls racing with one key apply once and all get the same answer:
/// threads repeat the same keyed patch, reserve and settle at once, many
/// rounds.
pub fn i6_racing_calls_with_one_key_apply_once(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("i6");
    let bk = BudgetKey::new(&t, "pool");
    ok(
        s.put_budget(BudgetRecord::new(
            bk.clone(),
            Caps::new().cost_micros(1_000_000_000),
        )),
        "I6: budget",
    );
    let rk = RunKey::new(&t, "r");
    create(s, RunRecord::new(rk.clone(), "planner").with_budget("pool"));
    let threads = 6;
    let n = rounds(30);
    for round in 0..n {
        let barrier = Barrier::new(threads);
        let answers: Vec<_> = std::thread::scope(|scope| {
            let hs: Vec<_> = (0..threads)
                .map(|_| {
                    let barrier = &barrier;
                    let rk = &rk;
                    scope.spawn(move || {
                        barrier.wait();
                        let p = s.patch_run_idempotent(rk, spend(1), &key(&format!("p{round}")));
                        let h = s.reserve_idempotent(
                            rk,
                            Hold::new(format!("h{round}"), 60_000).cost_micros(5),
                            &key(&format!("r{round}")),
                        );
                        let st = s.settle_idempotent(
                            rk,
                            &format!("h{round}"),
                            spend(2),
                            &key(&format!("s{round}")),
                        );
                        (p, h, st)
                    })
                })
                .collect();
            hs.into_iter().map(|h| join(h.join())).collect()
        });
        let (p0, h0, s0) = &answers[0];
        let (p0, h0, s0) = (
            ok(p0.clone_ok(), "I6: patch"),
            ok(h0.clone_ok(), "I6: reserve"),
            ok(s0.clone_ok(), "I6: settle"),
        );
        for (p, h, st) in &answers[1..] {
            assert_eq!(
                ok(p.clone_ok(), "I6: patch"),
                p0,
                "I6: round {round}: patch answers differ"
            );
            assert_eq!(
                ok(h.clone_ok(), "I6: reserve"),
                h0,
                "I6: round {round}: reserve answers differ"
            );
            assert_eq!(
                ok(st.clone_ok(), "I6: settle"),
                s0,
                "I6: round {round}: settle answers differ"
            );
        }
    }
    let r = must_get(s, &rk);
    assert_eq!(
        (r.cost_micros, r.iterations),
        (3 * n as u64, 2 * n as u64),
        "I6: every key applied exactly once"
    );
    assert_eq!(
        r.version,
        1 + 2 * n as u64,
        "I6: one patch and one settle per round"
    );
}

/// `Result<T>` is not `Clone` (errors hold I/O sources): the answer as a
/// fresh result to compare.
trait CloneOk<T> {
    fn clone_ok(&self) -> agentstate_core::Result<T>;
}

impl<T: Clone> CloneOk<T> for agentstate_core::Result<T> {
    fn clone_ok(&self) -> agentstate_core::Result<T> {
        match self {
            Ok(v) => Ok(v.clone()),
            Err(e) => Err(StateError::invalid(format!("{e:?}"))),
        }
    }
}
