//! T — trays, epochs and fencing: what a tray holds, the epoch fence,
//! batches, release, the sweeper's walk, atomic fence checks, an
//! instance's trays in one fenced call (T1–T7).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};

use super::helpers::*;
use super::{ConformanceStore, Factory};
use agentstate_core::limits::EPOCH_MAX;
use agentstate_core::{
    InstanceKey, MarkedTray, PageRequest, PersistenceReason, Result, StateError, Tray, TrayFilter,
    TrayKey, TrayOp,
};

/// T1: a tray holds `marked`, the whole `doc` (any bytes), `env` and
/// `hostname`; a write replaces it whole; the sweeper sees marked trays.
pub fn t1_tray_holds_marked_doc_env_hostname(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("t1");
    let (env, env2) = (unique("t1env"), unique("t1env2"));
    let i = InstanceKey::new(&ns, "i");
    let k = i.tray("inbox", "1");
    let k2 = i.tray("outbox", "1");
    assert_eq!(
        read_tray(s, &k, 1),
        None,
        "T1: a tray never written reads None"
    );

    let doc: Vec<u8> = (0..65_536u32)
        .map(|n| (n.wrapping_mul(2_654_435_761) >> 13) as u8)
        .chain([0, 0xff, 0])
        .collect();
    let t1 = Tray {
        marked: true,
        doc,
        env: env.clone(),
        hostname: "host-a".into(),
    };
    ok(s.write_tray(&k, 1, t1.clone()), "T1: write");
    assert_eq!(
        read_tray(s, &k, 1).as_ref(),
        Some(&t1),
        "T1: a tray reads back whole"
    );
    assert_eq!(
        tray_state(s, &i).1,
        vec![(k.clone(), t1.clone())],
        "T1: list_trays holds the tray"
    );
    assert_eq!(
        marked_of(s, Some(&env), &ns, 10),
        vec![MarkedTray::new(k.clone(), env.clone(), "host-a")],
        "T1: a marked tray is listed for the sweeper with its env and host"
    );

    let t2 = Tray {
        marked: false,
        doc: Vec::new(),
        env: env.clone(),
        hostname: "host-b".into(),
    };
    ok(s.write_tray(&k, 1, t2.clone()), "T1: overwrite");
    assert_eq!(
        read_tray(s, &k, 1).as_ref(),
        Some(&t2),
        "T1: a write replaces the whole tray (an empty doc too)"
    );
    assert!(
        marked_of(s, Some(&env), &ns, 10).is_empty(),
        "T1: an unmarked tray is not listed"
    );

    let t3 = Tray {
        marked: true,
        doc: b"moved".to_vec(),
        env: env2.clone(),
        hostname: "host-c".into(),
    };
    ok(s.write_tray(&k, 1, t3.clone()), "T1: marked in another env");
    assert!(
        marked_of(s, Some(&env), &ns, 10).is_empty(),
        "T1: a tray marked in env2 is not listed under env"
    );
    assert_eq!(
        marked_of(s, Some(&env2), &ns, 10),
        vec![MarkedTray::new(k.clone(), env2.clone(), "host-c")],
        "T1: the sweeper sees the tray's current env and host"
    );
    assert_eq!(
        marked_of(s, None, &ns, 1000).len(),
        1,
        "T1: the all-env listing sees it once"
    );

    let other = tray(false, "other", &env);
    ok(s.write_tray(&k2, 1, other.clone()), "T1: a second tray");
    assert_eq!(
        read_tray(s, &k, 1).as_ref(),
        Some(&t3),
        "T1: trays of one instance are separate"
    );
    assert!(
        ok(s.delete_tray(&k, 1), "T1: delete"),
        "T1: deleting an existing tray says true"
    );
    assert_eq!(read_tray(s, &k, 1), None, "T1: a deleted tray reads None");
    assert!(
        !ok(s.delete_tray(&k, 1), "T1: delete again"),
        "T1: deleting a missing tray says false"
    );
    assert!(
        marked_of(s, None, &ns, 1000).is_empty(),
        "T1: a deleted tray is not listed as marked"
    );
    assert_eq!(
        tray_state(s, &i).1,
        vec![(k2.clone(), other)],
        "T1: only the other tray is left"
    );
}

/// T2: each instance has a stored epoch (0 when none); every tray operation
/// at or above it advances it and runs; below it, `FenceLost` and nothing
/// changes. Epochs are per instance, and `EPOCH_MAX` (K7) is an epoch.
pub fn t2_epoch_fences_every_tray_operation(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("t2");
    let env = unique("t2env");
    let i = InstanceKey::new(&ns, "i");
    let k = i.tray("t", "1");
    assert_eq!(epoch_of(s, &i), 0, "T2: a new instance's epoch is 0");
    assert_eq!(
        read_tray(s, &k, 0),
        None,
        "T2: epoch 0 reads a new instance"
    );
    assert_eq!(
        epoch_of(s, &i),
        0,
        "T2: a read at the stored epoch keeps it"
    );

    // Each operation at a higher epoch advances it.
    type Step<'a> = (&'static str, u64, Box<dyn Fn(u64) -> Result<()> + 'a>);
    let steps: Vec<Step<'_>> = vec![
        (
            "write_tray",
            3,
            Box::new(|e| s.write_tray(&k, e, tray(true, "w", &env))),
        ),
        (
            "write_tray at the same epoch",
            3,
            Box::new(|e| s.write_tray(&k, e, tray(true, "w3", &env))),
        ),
        ("read_tray", 5, Box::new(|e| s.read_tray(&k, e).map(|_| ()))),
        (
            "delete_tray",
            6,
            Box::new(|e| s.delete_tray(&i.tray("t", "none"), e).map(|_| ())),
        ),
        (
            "apply_batch",
            7,
            Box::new(|e| {
                s.apply_batch(
                    &i,
                    e,
                    vec![TrayOp::Put {
                        tray_ns: "t".into(),
                        tray_id: "2".into(),
                        tray: tray(true, "b", &env),
                    }],
                )
            }),
        ),
        ("release", 8, Box::new(|e| s.release(&i, e))),
        (
            "list_trays",
            9,
            Box::new(|e| s.list_trays(&i, e, &PageRequest::new(10)).map(|_| ())),
        ),
        ("set_alarm", 10, Box::new(|e| s.set_alarm(&i, e, 500))),
        (
            "ack_alarm",
            11,
            Box::new(|e| s.ack_alarm(&i, e, 1).map(|_| ())),
        ),
        (
            "an empty batch",
            12,
            Box::new(|e| s.apply_batch(&i, e, Vec::new())),
        ),
    ];
    for (what, e, op) in &steps {
        ok(op(*e), format_args!("T2: {what} at epoch {e}"));
        assert_eq!(
            epoch_of(s, &i),
            *e,
            "T2: {what} at epoch {e} advances the stored epoch"
        );
    }
    ok(
        s.write_tray(&k, 12, tray(true, "at 12", &env)),
        "T2: write at 12",
    );
    ok(s.set_alarm(&i, 12, 500), "T2: alarm at 12");
    // Below: FenceLost, nothing changes.
    let before = (
        tray_state(s, &i),
        due_of(s, 1_000, &ns, 100),
        marked_of(s, Some(&env), &ns, 100),
    );
    for (what, _, op) in &steps {
        if what.starts_with("release") {
            continue;
        }
        expect_err!(
            op(11),
            StateError::FenceLost {
                caller: 11,
                stored: 12,
                ..
            },
            "T2: {what} at epoch 11 after 12"
        );
        assert_eq!(
            (
                tray_state(s, &i),
                due_of(s, 1_000, &ns, 100),
                marked_of(s, Some(&env), &ns, 100)
            ),
            before,
            "T2/E6: a fenced {what} changed the instance"
        );
    }

    // Epochs are per instance: same ns other id, same id other ns, and
    // look-alike ids are untouched.
    for other in [
        InstanceKey::new(&ns, "i2"),
        InstanceKey::new(format!("{ns}x"), "i"),
        InstanceKey::new(&ns, "i\0"),
    ] {
        assert_eq!(
            epoch_of(s, &other),
            0,
            "T2: {other:?} shares no epoch with {i:?}"
        );
        ok(
            s.write_tray(&other.tray("t", "1"), 1, tray(false, "o", &env)),
            "T2: another instance at epoch 1",
        );
    }
    // Trays of one instance share its epoch.
    expect_err!(
        s.write_tray(&i.tray("other-ns", "x"), 11, tray(false, "x", &env)),
        StateError::FenceLost {
            caller: 11,
            stored: 12,
            ..
        },
        "T2: another tray of the instance at an older epoch"
    );

    // The top of the range (K7: `EPOCH_MAX`, the seeds' bigint).
    ok(
        s.write_tray(&k, EPOCH_MAX, tray(false, "max", &env)),
        "T2: epoch EPOCH_MAX",
    );
    assert_eq!(epoch_of(s, &i), EPOCH_MAX, "T2: the epoch is EPOCH_MAX");
    ok(
        s.write_tray(&k, EPOCH_MAX, tray(false, "max again", &env)),
        "T2: EPOCH_MAX again",
    );
    expect_err!(
        s.write_tray(&k, EPOCH_MAX - 1, tray(false, "x", &env)),
        StateError::FenceLost { caller, stored: EPOCH_MAX, .. } if caller == EPOCH_MAX - 1,
        "T2: below EPOCH_MAX"
    );
    assert_eq!(
        read_tray(s, &k, EPOCH_MAX).map(|t| t.doc),
        Some(b"max again".to_vec()),
        "T2: the last write at EPOCH_MAX"
    );
}

/// T3: a batch applies all its writes and deletes atomically with one
/// fence check — all or nothing, and a reader never sees part of it.
pub fn t3_batch_all_or_nothing(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("t3");
    let env = unique("t3env");
    let i = InstanceKey::new(&ns, "i");
    let put = |id: &str, doc: &str, marked: bool| TrayOp::Put {
        tray_ns: "t".into(),
        tray_id: id.into(),
        tray: tray(marked, doc, &env),
    };
    let del = |id: &str| TrayOp::Delete {
        tray_ns: "t".into(),
        tray_id: id.into(),
    };
    let docs = |s: &dyn ConformanceStore| -> BTreeMap<String, Vec<u8>> {
        tray_state(s, &i)
            .1
            .into_iter()
            .map(|(k, t)| (k.tray_id, t.doc))
            .collect()
    };
    ok(
        s.apply_batch(&i, 1, vec![put("a", "a0", false), put("b", "b0", true)]),
        "T3: first batch",
    );
    ok(
        s.apply_batch(
            &i,
            1,
            vec![
                put("c", "c1", true),
                del("a"),
                put("b", "b1", false),
                del("never"),
            ],
        ),
        "T3: mixed batch",
    );
    let want: BTreeMap<String, Vec<u8>> = [
        ("b".to_string(), b"b1".to_vec()),
        ("c".to_string(), b"c1".to_vec()),
    ]
    .into();
    assert_eq!(docs(s), want, "T3: a batch applies every write and delete");
    assert_eq!(
        marked_of(s, Some(&env), &ns, 10)
            .into_iter()
            .map(|m| m.key.tray_id)
            .collect::<Vec<_>>(),
        vec!["c".to_string()],
        "T3: a batch keeps the sweeper's listing in step"
    );

    // Refused batches apply nothing, and move no epoch.
    let before = (tray_state(s, &i), marked_of(s, Some(&env), &ns, 10));
    let big = TrayOp::Put {
        tray_ns: "t".into(),
        tray_id: "big".into(),
        tray: tray(false, vec![1u8; 1_100_000], &env),
    };
    expect_err!(
        s.apply_batch(&i, 2, vec![put("d", "d", true), del("b"), big]),
        StateError::Persistence {
            reason: PersistenceReason::TooLarge,
            ..
        },
        "T3: a batch whose last op is too large"
    );
    assert_eq!(
        (tray_state(s, &i), marked_of(s, Some(&env), &ns, 10)),
        before,
        "T3: a refused batch applied part of itself"
    );
    expect_err!(
        s.apply_batch(
            &i,
            2,
            vec![
                put("d", "d", true),
                del("b"),
                put(&"x".repeat(257), "x", false)
            ]
        ),
        StateError::Invalid { .. },
        "T3: a batch whose last op has a bad id"
    );
    assert_eq!(
        (tray_state(s, &i), marked_of(s, Some(&env), &ns, 10)),
        before,
        "T3: a refused batch applied part of itself"
    );
    ok(
        s.write_tray(&i.tray("t", "c"), 3, tray(true, "c3", &env)),
        "T3: epoch 3",
    );
    let before = (tray_state(s, &i), marked_of(s, Some(&env), &ns, 10));
    expect_err!(
        s.apply_batch(&i, 2, vec![put("d", "d", true), del("b")]),
        StateError::FenceLost {
            caller: 2,
            stored: 3,
            ..
        },
        "T3: a fenced batch"
    );
    assert_eq!(
        (tray_state(s, &i), marked_of(s, Some(&env), &ns, 10)),
        before,
        "T3: a fenced batch applied part of itself"
    );

    // Ops apply in order: the last write of a tray wins.
    ok(
        s.apply_batch(
            &i,
            3,
            vec![
                put("x", "1", false),
                put("x", "2", false),
                put("y", "1", false),
                del("y"),
            ],
        ),
        "T3: ordered ops",
    );
    assert_eq!(
        read_tray(s, &i.tray("t", "x"), 3).map(|t| t.doc),
        Some(b"2".to_vec()),
        "T3: the later write of a tray wins"
    );
    assert_eq!(
        read_tray(s, &i.tray("t", "y"), 3),
        None,
        "T3: a delete after a write deletes"
    );

    // A reader never sees part of a batch: each batch writes one
    // generation to every tray, so trays read one after another (in
    // either order) show generations that never go back.
    let j = InstanceKey::new(&ns, "gen");
    let n = 8usize;
    let gen_batch = |g: u64| {
        (0..n)
            .map(|t| TrayOp::Put {
                tray_ns: "g".into(),
                tray_id: t.to_string(),
                tray: tray(false, g.to_be_bytes(), &env),
            })
            .collect::<Vec<_>>()
    };
    ok(s.apply_batch(&j, 1, gen_batch(0)), "T3: generation 0");
    let gens = rounds(150) as u64;
    let done = AtomicBool::new(false);
    let read_gen = |t: usize| -> u64 {
        let doc = read_tray(s, &j.tray("g", t.to_string()), 1)
            .expect("generation tray exists")
            .doc;
        u64::from_be_bytes(doc.try_into().expect("8-byte generation"))
    };
    std::thread::scope(|sc| {
        let reader = sc.spawn(|| {
            let mut passes = 0u64;
            while !done.load(Ordering::SeqCst) || passes == 0 {
                let order: Vec<usize> = (0..n).chain((0..n).rev()).collect();
                let seen: Vec<u64> = order.iter().map(|t| read_gen(*t)).collect();
                assert!(
                    seen.windows(2).all(|w| w[0] <= w[1]),
                    "T3: a reader saw part of a batch (trays {order:?} read generations {seen:?})"
                );
                passes += 1;
            }
        });
        let _done = OnDrop(|| done.store(true, Ordering::SeqCst));
        for g in 1..=gens {
            ok(
                s.apply_batch(&j, 1, gen_batch(g)),
                format_args!("T3: generation {g}"),
            );
        }
        done.store(true, Ordering::SeqCst);
        join(reader.join());
    });
    assert!(
        (0..n).all(|t| read_gen(t) == gens),
        "T3: every tray holds the last generation"
    );
}

/// T4: `release` unmarks the instance's trays (and only its); a release
/// with an older epoch is a no-op, not an error.
pub fn t4_release_unmarks_and_stale_release_is_noop(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("t4");
    let env = unique("t4env");
    let (i, other) = (InstanceKey::new(&ns, "i"), InstanceKey::new(&ns, "other"));
    let fill = |inst: &InstanceKey, e: u64| {
        let ops = (0..5)
            .map(|n| TrayOp::Put {
                tray_ns: "t".into(),
                tray_id: n.to_string(),
                tray: tray(n != 4, format!("doc-{n}"), &env),
            })
            .collect();
        ok(s.apply_batch(inst, e, ops), "T4: fill");
    };
    fill(&i, 5);
    fill(&other, 1);
    assert_eq!(marked_of(s, Some(&env), &ns, 100).len(), 8, "T4: fixture");

    // An older placement's release: Ok, and nothing changes.
    let before = (tray_state(s, &i), marked_of(s, Some(&env), &ns, 100));
    ok(
        s.release(&i, 4),
        "T4: release at an older epoch is not an error",
    );
    assert_eq!(
        (tray_state(s, &i), marked_of(s, Some(&env), &ns, 100)),
        before,
        "T4: an older release changed the instance"
    );
    ok(s.release(&i, 0), "T4: release at epoch 0");
    assert_eq!(
        (tray_state(s, &i), marked_of(s, Some(&env), &ns, 100)),
        before,
        "T4: an older release changed the instance"
    );

    // The current placement's release unmarks, and keeps the docs.
    ok(s.release(&i, 5), "T4: release at the stored epoch");
    let (e, trays) = tray_state(s, &i);
    assert_eq!(e, 5, "T4: a release at the stored epoch keeps it");
    assert_eq!(trays.len(), 5, "T4: a release deletes no tray");
    for (k, t) in &trays {
        assert!(!t.marked, "T4: {k:?} is still marked after release");
        assert_eq!(
            t.doc,
            format!("doc-{}", k.tray_id).into_bytes(),
            "T4: a release keeps the doc"
        );
        assert_eq!(t.env, env, "T4: a release keeps the env");
    }
    let left: Vec<InstanceKey> = marked_of(s, Some(&env), &ns, 100)
        .iter()
        .map(|m| m.key.instance())
        .collect();
    assert_eq!(
        left,
        vec![other.clone(); 4],
        "T4: only the other instance's trays are still marked"
    );

    // A newer release advances the epoch, and fences the old holder.
    fill(&i, 5);
    ok(s.release(&i, 8), "T4: release at a newer epoch");
    assert_eq!(epoch_of(s, &i), 8, "T4: a newer release advances the epoch");
    assert!(
        tray_state(s, &i).1.iter().all(|(_, t)| !t.marked),
        "T4: a newer release unmarks"
    );
    expect_err!(
        s.write_tray(&i.tray("t", "0"), 5, tray(true, "late", &env)),
        StateError::FenceLost {
            caller: 5,
            stored: 8,
            ..
        },
        "T4: the old holder after a newer release"
    );
    ok(
        s.release(&InstanceKey::new(&ns, "empty"), 1),
        "T4: releasing an instance with no trays",
    );
}

/// One T5 walk over a fresh env while three threads mark and unmark other
/// trays of that env.
fn t5_walk(s: &dyn ConformanceStore, walk_no: usize, all_envs: bool) {
    let rule = format!(
        "T5 walk {walk_no} ({})",
        if all_envs { "every env" } else { "one env" }
    );
    let ns = unique("t5");
    let (env, env2) = (unique("t5env"), unique("t5env2"));
    let stable: Vec<InstanceKey> = (0..4)
        .map(|n| InstanceKey::new(&ns, format!("stable-{n}")))
        .collect();
    let churn: Vec<InstanceKey> = (0..3)
        .map(|n| InstanceKey::new(&ns, format!("churn-{n}")))
        .collect();
    let mk = |marked: bool, env: &str, host: &str| Tray {
        marked,
        doc: b"doc".to_vec(),
        env: env.into(),
        hostname: host.into(),
    };
    par_map(&stable, |i| {
        let mut ops: Vec<TrayOp> = (0..6)
            .map(|n| TrayOp::Put {
                tray_ns: "m".into(),
                tray_id: n.to_string(),
                tray: mk(true, &env, "h-stable"),
            })
            .collect();
        ops.extend((0..2).map(|n| TrayOp::Put {
            tray_ns: "u".into(),
            tray_id: n.to_string(),
            tray: mk(false, &env, "h-stable"),
        }));
        ops.push(TrayOp::Put {
            tray_ns: "e2".into(),
            tray_id: "0".into(),
            tray: mk(true, &env2, "h-stable"),
        });
        ok(s.apply_batch(i, 1, ops), "T5: stable trays");
    });
    let churn_trays = |i: &InstanceKey| {
        (0..6)
            .map(|n| i.tray("c", n.to_string()))
            .collect::<Vec<_>>()
    };
    let mut must_see: Vec<TrayKey> = stable
        .iter()
        .flat_map(|i| (0..6).map(move |n| i.tray("m", n.to_string())))
        .collect();
    if all_envs {
        must_see.extend(stable.iter().map(|i| i.tray("e2", "0")));
    }
    let may_see: HashSet<TrayKey> = must_see
        .iter()
        .cloned()
        .chain(churn.iter().flat_map(churn_trays))
        .collect();

    let pace = Pace::new();
    let limit = 3;
    let (seen, ops) = std::thread::scope(|sc| {
        let (pace, churn, env, env2) = (&pace, &churn, &env, &env2);
        // Marks and unmarks single trays.
        sc.spawn(move || {
            for n in 0.. {
                if !pace.may_write(n, 2) {
                    break;
                }
                let k = churn[0].tray("c", (n % 6).to_string());
                ok(
                    s.write_tray(&k, 1, mk((n / 6) % 2 == 0, env, "h-churn")),
                    "T5: churn write",
                );
                pace.wrote();
            }
        });
        // Marks and unmarks whole batches, sometimes into the other env.
        sc.spawn(move || {
            for n in 0.. {
                if !pace.may_write(n, 1) {
                    break;
                }
                let e = if n % 4 == 1 { env2 } else { env };
                let ops = (0..6)
                    .map(|t| TrayOp::Put {
                        tray_ns: "c".into(),
                        tray_id: t.to_string(),
                        tray: mk(n % 2 == 0, e, "h-churn"),
                    })
                    .collect();
                ok(s.apply_batch(&churn[1], 1, ops), "T5: churn batch");
                pace.wrote();
            }
        });
        // Marks everything, then releases.
        sc.spawn(move || {
            for n in 0.. {
                if !pace.may_write(n, 1) {
                    break;
                }
                if n % 2 == 0 {
                    let ops = (0..6)
                        .map(|t| TrayOp::Put {
                            tray_ns: "c".into(),
                            tray_id: t.to_string(),
                            tray: mk(true, env, "h-churn"),
                        })
                        .collect();
                    ok(s.apply_batch(&churn[2], 1, ops), "T5: churn mark");
                } else {
                    ok(s.release(&churn[2], 1), "T5: churn release");
                }
                pace.wrote();
            }
        });
        let filter = if all_envs { None } else { Some(env.as_str()) };
        let _stop = OnDrop(|| pace.finish());
        let start = pace.writes();
        let seen = walk_with(
            &rule,
            limit,
            |c| s.marked_trays(filter, &PageRequest::new(limit).after(c)),
            || pace.page_read(2),
        );
        let ops = pace.writes() - start;
        pace.finish();
        (seen, ops)
    });
    assert!(
        ops > 0,
        "{rule}: the churn threads made no progress during the walk, so it tested nothing"
    );
    let ours: Vec<&MarkedTray> = seen.iter().filter(|m| m.key.ns == ns).collect();
    let mut count: HashMap<&TrayKey, usize> = HashMap::new();
    for m in &ours {
        *count.entry(&m.key).or_default() += 1;
        assert!(
            may_see.contains(&m.key),
            "{rule}: listed a tray that was never marked: {:?}",
            m.key
        );
        if !all_envs {
            assert_eq!(m.env, env, "{rule}: {:?} listed under another env", m.key);
        }
        let host = if m.key.id.starts_with("stable") {
            "h-stable"
        } else {
            "h-churn"
        };
        assert_eq!(
            m.hostname, host,
            "{rule}: {:?} listed with the wrong host",
            m.key
        );
    }
    let twice: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "{rule}: trays listed more than once in one walk: {twice:?}"
    );
    for k in &must_see {
        assert_eq!(
            count.get(k).copied().unwrap_or(0),
            1,
            "{rule}: {k:?} was marked during the whole walk, so it must be listed exactly once"
        );
    }
}

/// T5: the sweeper's listing pages every marked tray (optionally of one
/// env) exactly once per walk — unmarked trays and other envs never — while
/// other trays of the env are marked and unmarked.
pub fn t5_sweeper_pages_marked_trays_exactly_once(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    // At rest.
    let ns = unique("t5rest");
    let (env, env2) = (unique("t5e"), unique("t5e2"));
    let mut want_env: Vec<TrayKey> = Vec::new();
    let mut want_all: Vec<TrayKey> = Vec::new();
    for n in 0..3 {
        let i = InstanceKey::new(&ns, format!("i{n}"));
        let mut ops = Vec::new();
        for t in 0..7 {
            let (marked, e) = match t {
                0..=4 => (true, &env),
                5 => (false, &env),
                _ => (true, &env2),
            };
            ops.push(TrayOp::Put {
                tray_ns: "t".into(),
                tray_id: t.to_string(),
                tray: tray(marked, "d", e),
            });
            if marked {
                want_all.push(i.tray("t", t.to_string()));
                if e == &env {
                    want_env.push(i.tray("t", t.to_string()));
                }
            }
        }
        ok(s.apply_batch(&i, 1, ops), "T5: fill");
    }
    for limit in [1, 2, 1000] {
        let got: Vec<TrayKey> = marked_of(s, Some(&env), &ns, limit)
            .into_iter()
            .map(|m| m.key)
            .collect();
        assert_eq!(
            sorted(&got),
            sorted(&want_env),
            "T5: marked trays of one env, {limit} a page"
        );
        assert_eq!(got.len(), want_env.len(), "T5: each once");
        let got: Vec<TrayKey> = marked_of(s, None, &ns, limit)
            .into_iter()
            .map(|m| m.key)
            .collect();
        assert_eq!(
            sorted(&got),
            sorted(&want_all),
            "T5: marked trays of every env, {limit} a page"
        );
        assert_eq!(got.len(), want_all.len(), "T5: each once");
    }
    // While others mark and unmark.
    for walk_no in 0..rounds(4).max(2) {
        t5_walk(s, walk_no, walk_no % 2 == 1);
    }
}

/// T6: the epoch check and the write are one atomic step — once the
/// holder of epoch e + 1 has had an `Ok`, no write of the holder of epoch
/// e lands: it gets `FenceLost { caller: e, stored: e + 1 }`, and the
/// final doc is the e + 1 holder's last write.
pub fn t6_fence_check_and_write_are_atomic(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("t6");
    let total = rounds(300);
    let mut violations: Vec<String> = Vec::new();
    for round in 0..total {
        let i = InstanceKey::new(&ns, format!("r{round}"));
        let k = i.tray("t", "doc");
        let e: u64 = if round % 50 == 49 {
            EPOCH_MAX - 1
        } else {
            round as u64 * 2 + 1
        };
        // Alternate how the holders write: one tray write or a batch.
        let write = |epoch: u64, doc: String| -> Result<()> {
            let t = tray(true, doc, "env");
            if round % 2 == 0 {
                s.write_tray(&k, epoch, t)
            } else {
                s.apply_batch(
                    &i,
                    epoch,
                    vec![TrayOp::Put {
                        tray_ns: "t".into(),
                        tray_id: "doc".into(),
                        tray: t,
                    }],
                )
            }
        };
        let new_holder_ok = AtomicBool::new(false);
        let barrier = Barrier::new(2);
        let b_writes = 3;
        let (old_log, new_log) = std::thread::scope(|sc| {
            let old = sc.spawn(|| {
                let mut log = Vec::new();
                barrier.wait();
                let mut fenced = 0;
                for n in 0..2_000 {
                    let after_new_ok = new_holder_ok.load(Ordering::SeqCst);
                    let r = caught(|| write(e, format!("old-{n}")));
                    match r {
                        Ok(Ok(())) if fenced > 0 => log.push(format!("write {n} at epoch {e} was Ok after an earlier FenceLost")),
                        Ok(Ok(())) if after_new_ok => {
                            log.push(format!("write {n} at epoch {e} was Ok after the epoch-{} holder's Ok", e + 1))
                        }
                        Ok(Ok(())) => {}
                        Ok(Err(StateError::FenceLost { caller, stored, .. })) if caller == e && stored == e + 1 => {
                            fenced += 1;
                            if fenced == 3 {
                                break;
                            }
                        }
                        Ok(Err(other)) => log.push(format!("write {n} at epoch {e}: expected Ok or FenceLost {{ caller: {e}, stored: {} }}, got {other:?}", e + 1)),
                        Err(p) => log.push(format!("write {n} at epoch {e} panicked: {p}")),
                    }
                }
                log
            });
            let new = sc.spawn(|| {
                let mut log = Vec::new();
                barrier.wait();
                for n in 0..b_writes {
                    match caught(|| write(e + 1, format!("new-{n}"))) {
                        Ok(Ok(())) => new_holder_ok.store(true, Ordering::SeqCst),
                        other => log.push(format!(
                            "write {n} at the newest epoch {}: expected Ok, got {other:?}",
                            e + 1
                        )),
                    }
                }
                log
            });
            (join(old.join()), join(new.join()))
        });
        for v in old_log.iter().chain(&new_log) {
            violations.push(format!("round {round}: {v}"));
        }
        let last = read_tray(s, &k, e + 1).map(|t| String::from_utf8_lossy(&t.doc).into_owned());
        if last.as_deref() != Some(&format!("new-{}", b_writes - 1)) {
            violations.push(format!(
                "round {round}: the final doc is {last:?}, not the epoch-{} holder's last write",
                e + 1
            ));
        }
        if epoch_of(s, &i) != e + 1 {
            violations.push(format!(
                "round {round}: the stored epoch is {}, not {}",
                epoch_of(s, &i),
                e + 1
            ));
        }
        assert!(
            violations.len() < 20,
            "T6: the fence check and the write are not one step: {violations:#?}"
        );
    }
    assert!(
        violations.is_empty(),
        "T6: the fence check and the write are not one step: {violations:#?}"
    );
}

/// The instance's trays that pass `f`, as `instance_trays` answers them.
fn inst_trays(
    s: &dyn ConformanceStore,
    i: &InstanceKey,
    epoch: u64,
    f: &TrayFilter,
) -> Vec<(TrayKey, Tray)> {
    ok(
        s.instance_trays(i, epoch, f),
        format_args!("instance_trays {i:?} at epoch {epoch} with {f:?}"),
    )
}

/// T7: `instance_trays(instance, epoch, filter)` fences as every tray call
/// (at or above the stored epoch it advances it; below, `FenceLost` and
/// nothing changes) and answers every tray of the instance that passes the
/// filter (`tray_ns`, `marked`, AND-ed), in (tray_ns, tray_id) byte order,
/// nothing paged: an empty instance is an empty list, a deleted tray is
/// gone, the alarm's row never appears, and a filter's `tray_ns` is an id
/// (K1: `Invalid`, nothing changes).
pub fn t7_instance_trays_one_fenced_call(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("t7");
    let env = unique("t7env");
    let i = InstanceKey::new(&ns, "i");
    let none = TrayFilter::new();

    // An instance with nothing: an empty list, at its epoch or above it
    // (which advances the epoch).
    assert_eq!(inst_trays(s, &i, 0, &none), [], "T7: an empty instance");
    assert_eq!(epoch_of(s, &i), 0, "T7: at the stored epoch it stays");
    assert_eq!(
        inst_trays(s, &i, 3, &TrayFilter::new().tray_ns("t").marked(true)),
        [],
        "T7: an empty instance, filtered"
    );
    assert_eq!(epoch_of(s, &i), 3, "T7: a higher epoch is stored");

    // Names whose byte order differs from a collation's, and prefixes of
    // one another: "B" < "a" < "a\0" < "ab" < "z" < "é".
    let names = ["é", "z", "ab", "a\0", "a", "B", "pinned"];
    let ids = ["2", "10", "1", "b", "A", "é"];
    let mut want: BTreeMap<(String, String), Tray> = BTreeMap::new();
    let mut ops = Vec::new();
    for (n, tray_ns) in names.iter().enumerate() {
        for (m, tray_id) in ids.iter().enumerate() {
            let t = tray(
                (n + m) % 3 == 0,
                format!("{tray_ns}/{tray_id}").into_bytes(),
                &env,
            );
            want.insert((tray_ns.to_string(), tray_id.to_string()), t.clone());
            ops.push(TrayOp::Put {
                tray_ns: tray_ns.to_string(),
                tray_id: tray_id.to_string(),
                tray: t,
            });
        }
    }
    // More than a page of `list_trays` in one namespace.
    for n in 0..1_100 {
        let t = tray(n % 7 == 0, format!("bulk {n}").into_bytes(), &env);
        want.insert(("m".into(), format!("{n:05}")), t.clone());
        ops.push(TrayOp::Put {
            tray_ns: "m".into(),
            tray_id: format!("{n:05}"),
            tray: t,
        });
    }
    ok(s.apply_batch(&i, 3, ops), "T7: the fixture batch");
    // The alarm (the seeds' ("pinned", "alarm") row) and look-alike
    // instances, none of which may appear.
    ok(s.set_alarm(&i, 3, 1_000), "T7: the instance's alarm");
    for other in [
        InstanceKey::new(&ns, "i\0"),
        InstanceKey::new(&ns, "ix"),
        InstanceKey::new(format!("{ns}\0"), "i"),
    ] {
        ok(
            s.write_tray(&other.tray("a", "1"), 1, tray(true, "other", &env)),
            format_args!("T7: a tray of {other:?}"),
        );
    }

    type Want = BTreeMap<(String, String), Tray>;
    let expect = |want: &Want, f: &TrayFilter| -> Vec<(TrayKey, Tray)> {
        want.iter()
            .map(|((tn, ti), t)| (i.tray(tn, ti), t.clone()))
            .filter(|(k, t)| {
                f.tray_ns.as_ref().is_none_or(|n| *n == k.tray_ns)
                    && f.marked.is_none_or(|m| m == t.marked)
            })
            .collect()
    };
    let check = |want: &Want, f: &TrayFilter, what: &str| {
        let got = inst_trays(s, &i, 3, f);
        let exp = expect(want, f);
        if got != exp {
            let keys = |v: &[(TrayKey, Tray)]| -> Vec<(String, String)> {
                v.iter()
                    .map(|(k, _)| (k.tray_ns.clone(), k.tray_id.clone()))
                    .take(40)
                    .collect()
            };
            panic!(
                "T7: {what} ({f:?}): got {} trays, want {}; first keys got {:?}, want {:?}",
                got.len(),
                exp.len(),
                keys(&got),
                keys(&exp)
            );
        }
        got.len()
    };
    assert_eq!(
        check(&want, &none, "every tray, in (tray_ns, tray_id) byte order"),
        want.len()
    );
    assert!(
        check(&want, &TrayFilter::new().marked(true), "the marked trays") > 0,
        "T7: the fixture has marked trays"
    );
    assert!(
        check(
            &want,
            &TrayFilter::new().marked(false),
            "the unmarked trays"
        ) > 0
    );
    for n in names.iter().chain(&["m"]) {
        assert!(
            check(&want, &TrayFilter::new().tray_ns(*n), "one tray namespace") > 0,
            "T7: namespace {n:?} has trays"
        );
        for m in [true, false] {
            check(
                &want,
                &TrayFilter::new().tray_ns(*n).marked(m),
                "a namespace and a mark together",
            );
        }
    }
    for n in ["alarm", "a\0\0", "A", "zz", "m0"] {
        assert_eq!(
            check(
                &want,
                &TrayFilter::new().tray_ns(n),
                "a namespace with no trays"
            ),
            0
        );
    }
    let pinned = inst_trays(s, &i, 3, &TrayFilter::new().tray_ns("pinned"));
    assert!(
        pinned.iter().all(|(k, _)| k.tray_id != "alarm") && pinned.len() == ids.len(),
        "T7/A4: the alarm's row never appears: {:?}",
        pinned.iter().map(|(k, _)| &k.tray_id).collect::<Vec<_>>()
    );

    // A deleted tray is gone; a release unmarks every tray.
    ok(s.delete_tray(&i.tray("a", "1"), 3), "T7: delete a tray");
    want.remove(&("a".to_string(), "1".to_string()));
    ok(
        s.apply_batch(
            &i,
            3,
            vec![TrayOp::Delete {
                tray_ns: "m".into(),
                tray_id: "00000".into(),
            }],
        ),
        "T7: delete a tray in a batch",
    );
    want.remove(&("m".to_string(), "00000".to_string()));
    check(&want, &none, "after deletes");
    check(
        &want,
        &TrayFilter::new().tray_ns("a"),
        "a namespace after a delete",
    );

    // The fence: below the stored epoch, `FenceLost` and nothing changes.
    let before = tray_state(s, &i);
    for f in [none.clone(), TrayFilter::new().tray_ns("a").marked(true)] {
        expect_err!(
            s.instance_trays(&i, 2, &f),
            StateError::FenceLost {
                caller: 2,
                stored: 3,
                ..
            },
            "T7: instance_trays at epoch 2 after 3 ({f:?})"
        );
        assert_eq!(
            tray_state(s, &i),
            before,
            "T7/E6: a fenced call changed the instance"
        );
    }
    // Above it: the epoch is advanced, and an older holder is fenced.
    check_at(s, &i, 7, &expect(&want, &none));
    assert_eq!(epoch_of(s, &i), 7, "T7: instance_trays advances the epoch");
    expect_err!(
        s.write_tray(&i.tray("a", "x"), 6, tray(false, "late", &env)),
        StateError::FenceLost {
            caller: 6,
            stored: 7,
            ..
        },
        "T7: a write of the holder it fenced"
    );
    ok(s.release(&i, 7), "T7: release");
    assert_eq!(
        inst_trays(s, &i, 7, &TrayFilter::new().marked(true)),
        [],
        "T7: after a release nothing is marked"
    );
    assert_eq!(
        inst_trays(s, &i, 7, &none).len(),
        want.len(),
        "T7: a release keeps every tray"
    );

    // A filter's tray_ns is an id (K1), and the instance's ids too: a bad
    // one is `Invalid` naming it, and the epoch does not move.
    let before = tray_state(s, &i);
    for bad in [
        String::new(),
        "x".repeat(agentstate_core::limits::ID_BYTES_MAX + 1),
    ] {
        let e = expect_err!(
            s.instance_trays(&i, 9, &TrayFilter::new().tray_ns(bad.clone())),
            StateError::Invalid { .. },
            "T7: a filter's tray_ns of {} bytes",
            bad.len()
        );
        assert_names(&e, &["tray_ns"], "T7: a bad filter tray_ns");
        expect_err!(
            s.instance_trays(&InstanceKey::new(&ns, bad.clone()), 9, &none),
            StateError::Invalid { .. },
            "T7: an instance id of {} bytes",
            bad.len()
        );
    }
    assert_eq!(
        tray_state(s, &i),
        before,
        "T7/E6: a refused call moved the epoch or changed a tray"
    );
    assert_eq!(epoch_of(s, &i), 7, "T7: a refused call keeps the epoch");
}

/// `instance_trays` at `epoch` with no filter answers `want`.
#[track_caller]
fn check_at(s: &dyn ConformanceStore, i: &InstanceKey, epoch: u64, want: &[(TrayKey, Tray)]) {
    let got = inst_trays(s, i, epoch, &TrayFilter::new());
    assert!(
        got == want,
        "T7: instance_trays at epoch {epoch}: {} trays, want {}",
        got.len(),
        want.len()
    );
}
