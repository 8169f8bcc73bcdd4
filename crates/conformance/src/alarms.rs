//! A — alarms: one per instance, due in order, due until acked, and the
//! alarm's tray name reserved (A1–A4).

use super::Factory;
use super::helpers::*;
use agentstate_core::{ALARM_TRAY, Alarm, InstanceKey, Millis, PageRequest, StateError, TrayOp};

/// A1: one alarm per instance; `set_alarm` replaces it.
pub fn a1_one_alarm_per_instance(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("a1");
    let (i, j) = (InstanceKey::new(&ns, "i"), InstanceKey::new(&ns, "j"));
    ok(s.set_alarm(&i, 1, 500), "A1: set");
    ok(s.set_alarm(&i, 1, 300), "A1: replace with an earlier time");
    assert_eq!(
        due_of(s, 1_000, &ns, 10),
        vec![alarm(&i, 300)],
        "A1: the later set replaces the earlier"
    );
    ok(s.set_alarm(&j, 1, 400), "A1: another instance");
    assert_eq!(
        due_of(s, 1_000, &ns, 10),
        vec![alarm(&i, 300), alarm(&j, 400)],
        "A1: one alarm per instance"
    );
    ok(s.set_alarm(&i, 1, 2_000), "A1: replace with a later time");
    assert_eq!(
        due_of(s, 1_000, &ns, 10),
        vec![alarm(&j, 400)],
        "A1: the replaced alarm is no longer due"
    );
    assert_eq!(
        due_of(s, 2_000, &ns, 1),
        vec![alarm(&j, 400), alarm(&i, 2_000)],
        "A1: the new alarm is due at its time"
    );
    ok(s.set_alarm(&i, 1, 2_000), "A1: the same time again");
    assert_eq!(
        due_of(s, 2_000, &ns, 10),
        vec![alarm(&j, 400), alarm(&i, 2_000)],
        "A1: setting the same time keeps one alarm"
    );
    ok(
        s.write_tray(&i.tray("t", "1"), 2, tray(false, "x", "env")),
        "A1: epoch 2",
    );
    expect_err!(
        s.set_alarm(&i, 1, 5),
        StateError::FenceLost {
            caller: 1,
            stored: 2,
            ..
        },
        "A1: a fenced set_alarm"
    );
    assert_eq!(
        due_of(s, 2_000, &ns, 10),
        vec![alarm(&j, 400), alarm(&i, 2_000)],
        "A1/E6: a fenced set_alarm changed the alarm"
    );
}

/// A2: `due_alarms(now, ..)` pages the alarms with `due_at <= now` in
/// `(due_at, ns, id)` order.
pub fn a2_due_alarms_in_order(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let p = unique("a2");
    let spec: [(&str, &str, Millis); 9] = [
        ("b", "2", 200),
        ("a", "9", 200),
        ("a", "10", 200),
        ("c", "1", 100),
        ("a", "1", 300),
        ("z", "z", 301),
        ("m", "max", u64::MAX),
        ("a", "zero", 0),
        ("a\0", "1", 200),
    ];
    let alarms: Vec<Alarm> = spec
        .iter()
        .map(|(ns, id, due)| alarm(&InstanceKey::new(format!("{p}{ns}"), *id), *due))
        .collect();
    par_map(&alarms, |a| {
        ok(s.set_alarm(&a.instance, 1, a.due_at), "A2: set_alarm")
    });
    let order = |a: &Alarm| (a.due_at, a.instance.ns.clone(), a.instance.id.clone());
    let due_by = |now: Millis| {
        let mut v: Vec<Alarm> = alarms.iter().filter(|a| a.due_at <= now).cloned().collect();
        v.sort_by_key(order);
        v
    };
    for now in [0, 99, 100, 199, 200, 300, 301, u64::MAX - 1, u64::MAX] {
        for limit in [1, 2, 1000] {
            assert_eq!(
                due_of(s, now, &p, limit),
                due_by(now),
                "A2: due at {now}, {limit} a page, in (due_at, ns, id) order"
            );
        }
    }
    // The whole listing, others' alarms included, is in order.
    let everything = walk("A2: due_alarms", 7, |c| {
        s.due_alarms(u64::MAX, &PageRequest::new(7).after(c))
    });
    assert!(
        everything.windows(2).all(|w| order(&w[0]) < order(&w[1])),
        "A2: the due listing is not in strictly ascending (due_at, ns, id) order"
    );
}

/// A3: an alarm stays due until acked with its `due_at`; an ack for a
/// replaced `due_at` removes nothing, so a failed run fires again.
pub fn a3_alarm_stays_due_until_acked(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("a3");
    let i = InstanceKey::new(&ns, "i");
    ok(s.set_alarm(&i, 1, 100), "A3: set");
    for pass in 0..3 {
        assert_eq!(
            due_of(s, 150, &ns, 10),
            vec![alarm(&i, 100)],
            "A3: pass {pass}: an unacked alarm stays due (at-least-once)"
        );
    }
    assert!(
        ok(s.ack_alarm(&i, 1, 100), "A3: ack"),
        "A3: an ack of the due alarm removes it"
    );
    assert!(
        due_of(s, u64::MAX, &ns, 10).is_empty(),
        "A3: an acked alarm is gone"
    );
    assert!(
        !ok(s.ack_alarm(&i, 1, 100), "A3: ack again"),
        "A3: a second ack removes nothing"
    );

    // Replaced between the sweep and the ack.
    ok(s.set_alarm(&i, 1, 100), "A3: set again");
    let fired = due_of(s, 150, &ns, 10);
    assert_eq!(fired, vec![alarm(&i, 100)], "A3: due");
    ok(
        s.set_alarm(&i, 1, 120),
        "A3: rescheduled while the first fired",
    );
    assert!(
        !ok(
            s.ack_alarm(&i, 1, fired[0].due_at),
            "A3: ack of the replaced time"
        ),
        "A3: an ack of a replaced due_at removes nothing"
    );
    assert_eq!(
        due_of(s, 150, &ns, 10),
        vec![alarm(&i, 120)],
        "A3: the replacing alarm stays due"
    );
    assert!(
        !ok(s.ack_alarm(&i, 1, 121), "A3: ack of a time never set"),
        "A3: an ack of another time removes nothing"
    );
    assert_eq!(
        due_of(s, 150, &ns, 10),
        vec![alarm(&i, 120)],
        "A3: the alarm stays due"
    );

    // A fenced ack removes nothing either.
    ok(
        s.write_tray(&i.tray("t", "1"), 2, tray(false, "x", "env")),
        "A3: epoch 2",
    );
    expect_err!(
        s.ack_alarm(&i, 1, 120),
        StateError::FenceLost {
            caller: 1,
            stored: 2,
            ..
        },
        "A3: a fenced ack"
    );
    assert_eq!(
        due_of(s, 150, &ns, 10),
        vec![alarm(&i, 120)],
        "A3: a fenced ack removed the alarm"
    );
    assert!(
        ok(s.ack_alarm(&i, 2, 120), "A3: ack at the current epoch"),
        "A3: the current holder's ack removes it"
    );
    assert!(due_of(s, u64::MAX, &ns, 10).is_empty(), "A3: acked");
}

/// A4: the tray name `("pinned", "alarm")` is the instance's alarm (on
/// PostgreSQL, the alarm's row of `pinned_tray_index`): every tray call
/// refuses it as `Invalid` and changes nothing, and an alarm shows in no
/// tray listing, is not cleared by `release` and stays due.
pub fn a4_the_alarm_tray_name_is_reserved(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("a4");
    let i = InstanceKey::new(&ns, "i");
    let (tns, tid) = ALARM_TRAY;
    let k = i.tray(tns, tid);
    ok(s.set_alarm(&i, 1, 100), "A4: set");
    ok(
        s.write_tray(&i.tray("t", "1"), 1, tray(true, "x", "env")),
        "A4: a marked tray beside the alarm",
    );
    let what =
        |e: &StateError| matches!(e, StateError::Invalid { what } if what.contains("reserved"));
    expect_err!(
        s.write_tray(&k, 1, tray(true, "x", "env")),
        ref e if what(e),
        "A4: write_tray of the alarm's name"
    );
    expect_err!(s.read_tray(&k, 1), ref e if what(e), "A4: read_tray");
    expect_err!(s.delete_tray(&k, 1), ref e if what(e), "A4: delete_tray");
    for op in [
        TrayOp::Put {
            tray_ns: tns.into(),
            tray_id: tid.into(),
            tray: tray(true, "x", "env"),
        },
        TrayOp::Delete {
            tray_ns: tns.into(),
            tray_id: tid.into(),
        },
    ] {
        let ops = vec![
            TrayOp::Delete {
                tray_ns: "t".into(),
                tray_id: "1".into(),
            },
            op,
        ];
        expect_err!(s.apply_batch(&i, 1, ops), ref e if what(e), "A4: apply_batch");
    }
    let listed: Vec<_> = tray_state(s, &i).1.into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        listed,
        vec![i.tray("t", "1")],
        "A4: list_trays shows the tray alone"
    );
    let marked: Vec<_> = marked_of(s, None, &ns, 1)
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(
        marked,
        vec![i.tray("t", "1")],
        "A4: marked_trays shows the tray alone"
    );
    ok(s.release(&i, 1), "A4: release");
    assert!(marked_of(s, None, &ns, 10).is_empty(), "A4: released");
    assert_eq!(
        due_of(s, 150, &ns, 10),
        vec![alarm(&i, 100)],
        "A4: a release leaves the alarm due"
    );
    assert!(ok(s.ack_alarm(&i, 1, 100), "A4: ack"), "A4: acked");
    let listed: Vec<_> = tray_state(s, &i).1.into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        listed,
        vec![i.tray("t", "1")],
        "A4: an ack leaves the trays"
    );
}
