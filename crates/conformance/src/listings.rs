//! L — listings: `seq` order and filters, stable walks, the last page,
//! `updated_before`, page limits, cursors bound to their listing (L1–L6).

use std::collections::{HashMap, HashSet};
use std::fmt::Display;

use super::helpers::*;
use super::{ConformanceStore, Factory};
use agentstate_core::limits::{PAGE_ITEMS_DEFAULT, PAGE_ITEMS_MAX};
use agentstate_core::{
    Approval, Cursor, InstanceKey, Millis, Page, PageRequest, Result, RunKey, RunRecord, RunState,
    SessionKey, StateDelta, StateError, StateQuery, TrayOp,
};

/// L1: `list_runs` pages a tenant's runs in `seq` order, filtered by state,
/// session and agent (alone and together).
pub fn l1_list_runs_in_seq_order_with_filters(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("l1");
    for sess in ["s1", "s2"] {
        create_session(s, &SessionKey::new(&t, sess));
    }
    let recs: Vec<RunRecord> = (0..42)
        .map(|i| {
            let r = run_in(
                RunKey::new(&t, format!("r{i:02}")),
                ["a1", "a2", "a3"][i % 3],
                RunState::ALL[i % 7],
            );
            match (i / 3) % 3 {
                0 => r,
                1 => r.with_session("s1"),
                _ => r.with_session("s2"),
            }
        })
        .collect();
    let mut created = create_many(s, recs);
    // A state change keeps a run's place in the listing (its seq). (A
    // finished run stays finished: R9.)
    for r in created
        .iter_mut()
        .step_by(4)
        .filter(|r| !r.state.is_finished())
    {
        let k = r.key.clone();
        *r = update(s, &k, |r| r.state = RunState::Running);
    }
    // Another tenant's run with the same ids never shows.
    create(
        s,
        RunRecord::new(RunKey::new(unique("l1other"), "r00"), "a1"),
    );
    let all = by_seq(created);
    assert!(
        all.windows(2).all(|w| w[0].seq < w[1].seq),
        "L1: every run has its own seq"
    );

    type Filter = Box<dyn Fn(&RunRecord) -> bool>;
    let st = |x: RunState| move |r: &RunRecord| r.state == x;
    let queries: Vec<(StateQuery, Filter)> = vec![
        (StateQuery::new(&t), Box::new(|_| true)),
        (
            StateQuery::new(&t).state(RunState::Running),
            Box::new(st(RunState::Running)),
        ),
        (
            StateQuery::new(&t).state(RunState::Completed),
            Box::new(st(RunState::Completed)),
        ),
        (
            StateQuery::new(&t).agent("a2"),
            Box::new(|r| r.agent_name == "a2"),
        ),
        (
            StateQuery::new(&t).session("s1"),
            Box::new(|r| r.session_id.as_deref() == Some("s1")),
        ),
        (
            StateQuery::new(&t).state(RunState::Running).agent("a1"),
            Box::new(|r| r.state == RunState::Running && r.agent_name == "a1"),
        ),
        (
            StateQuery::new(&t).session("s2").agent("a3"),
            Box::new(|r| r.session_id.as_deref() == Some("s2") && r.agent_name == "a3"),
        ),
        (
            StateQuery::new(&t)
                .session("s1")
                .state(RunState::Running)
                .agent("a1"),
            Box::new(|r| {
                r.session_id.as_deref() == Some("s1")
                    && r.state == RunState::Running
                    && r.agent_name == "a1"
            }),
        ),
        (StateQuery::new(&t).agent("nobody"), Box::new(|_| false)),
    ];
    for (q, keep) in &queries {
        let want: Vec<RunRecord> = all.iter().filter(|r| keep(r)).cloned().collect();
        for limit in [1, 4, 1000] {
            let got = walk_runs_by(s, q, limit);
            assert_eq!(
                keys(&got),
                keys(&want),
                "L1: {q:?}, {limit} a page, lists the matching runs in seq order"
            );
            assert_eq!(
                got, want,
                "L1: {q:?}, {limit} a page, lists the stored records"
            );
        }
    }
}

/// The kind of an L2 fixture run, from its id.
fn l2_kind(k: &RunKey) -> &str {
    k.run_id.split('-').next().unwrap_or("")
}

/// One L2 walk over a fresh tenant while three threads create, update and
/// delete its runs.
fn l2_walk(s: &dyn ConformanceStore, walk_no: usize, by_agent: bool) {
    let rule = format!(
        "L2 walk {walk_no} ({} filter)",
        if by_agent { "agent" } else { "state" }
    );
    let t = unique("l2");
    let doomed: Vec<SessionKey> = (0..5)
        .map(|i| SessionKey::new(&t, format!("doomed-{i}")))
        .collect();
    par_map(&doomed, |k| create_session(s, k));
    // Kinds: stable (Running, "keep"), volatile ("keep", state flips),
    // other (Running, "other"), finished (Completed, "other"), doomed
    // (Running, "keep", deleted with its session during the walk).
    let mut recs = Vec::new();
    for i in 0..40 {
        recs.push(run_in(
            RunKey::new(&t, format!("stable-{i}")),
            "keep",
            RunState::Running,
        ));
        if i < 20 {
            recs.push(run_in(
                RunKey::new(&t, format!("volatile-{i}")),
                "keep",
                RunState::Running,
            ));
            recs.push(run_in(
                RunKey::new(&t, format!("other-{i}")),
                "other",
                RunState::Running,
            ));
            recs.push(run_in(
                RunKey::new(&t, format!("finished-{i}")),
                "other",
                RunState::Completed,
            ));
            recs.push(
                run_in(
                    RunKey::new(&t, format!("doomed-{i}")),
                    "keep",
                    RunState::Running,
                )
                .with_session(format!("doomed-{}", i % 5)),
            );
        }
    }
    let before: HashSet<RunKey> = keys(&create_many(s, recs)).into_iter().collect();
    let of_kind = |kind: &str| -> Vec<RunKey> {
        let mut v: Vec<RunKey> = before
            .iter()
            .filter(|k| l2_kind(k) == kind)
            .cloned()
            .collect();
        v.sort();
        v
    };
    let (stable, volatile, other) = (of_kind("stable"), of_kind("volatile"), of_kind("other"));
    // What matches the filter for the whole walk, whatever the writers do.
    let must_see: Vec<RunKey> = stable
        .iter()
        .chain(if by_agent { &volatile } else { &other })
        .cloned()
        .collect();
    let q = if by_agent {
        StateQuery::new(&t).agent("keep")
    } else {
        StateQuery::new(&t).state(RunState::Running)
    };
    let limit = 3;
    let matches = |r: &RunRecord| {
        if by_agent {
            r.agent_name == "keep"
        } else {
            r.state == RunState::Running
        }
    };
    let updated: Vec<RunKey> = stable.iter().chain(&other).cloned().collect();

    let pace = Pace::new();
    let (seen, made, ops) = std::thread::scope(|sc| {
        let pace = &pace;
        let creator = sc.spawn(|| {
            let mut made = Vec::new();
            let kinds = [
                ("keep", RunState::Running),
                ("keep", RunState::Paused),
                ("other", RunState::Running),
                ("other", RunState::Completed),
            ];
            for i in 0..400 {
                if !pace.may_write(i, 2) {
                    break;
                }
                let (agent, state) = kinds[i % kinds.len()];
                made.push(create(s, run_in(RunKey::new(&t, format!("new-{i}")), agent, state)).key);
                pace.wrote();
            }
            made
        });
        sc.spawn(|| {
            for i in 0.. {
                if !pace.may_write(i, 2) {
                    break;
                }
                let k = &updated[i % updated.len()];
                match i % 3 {
                    0 => {
                        update(s, k, |r| {
                            r.approval = Some(Approval {
                                id: format!("ap-{i}"),
                                prompt: "ok?".into(),
                            })
                        });
                    }
                    1 => {
                        ok(
                            s.patch_run(
                                k,
                                StateDelta {
                                    iterations: 1,
                                    ..Default::default()
                                },
                            ),
                            "L2: patch",
                        );
                    }
                    _ => {
                        let v = &volatile[i % volatile.len()];
                        update(s, v, |r| {
                            r.state = if r.state == RunState::Running {
                                RunState::Paused
                            } else {
                                RunState::Running
                            }
                        });
                    }
                }
                pace.wrote();
            }
        });
        sc.spawn(|| {
            // One session (four matching runs) every other page.
            for (n, sk) in doomed.iter().enumerate() {
                if !pace.may_write(n * 2 + 1, 1) {
                    break;
                }
                ok(s.delete_session(sk, true), "L2: cascade delete");
                pace.wrote();
            }
        });
        let _stop = OnDrop(|| pace.finish());
        let start = pace.writes();
        let seen = walk_with(
            &rule,
            limit,
            |c| s.list_runs(&q, &PageRequest::new(limit).after(c)),
            || pace.page_read(2),
        );
        let ops = pace.writes() - start;
        pace.finish();
        (seen, join(creator.join()), ops)
    });
    assert!(
        ops > 0,
        "{rule}: the writers made no progress during the walk, so it tested nothing"
    );

    let made: HashSet<RunKey> = made.into_iter().collect();
    let mut count: HashMap<&RunKey, usize> = HashMap::new();
    for r in &seen {
        *count.entry(&r.key).or_default() += 1;
        assert!(
            before.contains(&r.key) || made.contains(&r.key),
            "{rule}: the walk returned a run never written: {:?}",
            r.key
        );
        assert!(
            matches(r),
            "{rule}: the walk returned {:?}, which does not match {q:?}",
            r.key
        );
    }
    let twice: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "{rule}: runs seen more than once in one walk: {twice:?}"
    );
    for k in &must_see {
        assert_eq!(
            count.get(k).copied().unwrap_or(0),
            1,
            "{rule}: {k:?} existed and matched during the whole walk, so it must be seen exactly once"
        );
    }
    assert!(
        seen.windows(2).all(|w| w[0].seq < w[1].seq),
        "{rule}: the walk is not in seq order: {:?}",
        seen.iter().map(|r| r.seq).collect::<Vec<_>>()
    );
    let last_old = seen.iter().rposition(|r| before.contains(&r.key));
    let first_new = seen.iter().position(|r| made.contains(&r.key));
    if let (Some(o), Some(n)) = (last_old, first_new) {
        assert!(
            n > o,
            "{rule}: a run created during the walk came before a run that existed at its start"
        );
    }
}

/// L2: walking the cursors visits every record that matched for the whole
/// walk exactly once, while other threads create, update and delete
/// records; records created during the walk appear at most once, after all
/// earlier ones.
pub fn l2_walk_sees_stable_records_exactly_once(make: Factory<'_>) {
    let c = open(make);
    for walk_no in 0..rounds(4).max(2) {
        l2_walk(&*c.store, walk_no, walk_no % 2 == 1);
    }
}

/// L3: the page that ends a walk has no cursor, an empty page never carries
/// one (`Page::new` refuses it), on every listing.
pub fn l3_last_page_has_no_cursor(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    assert!(Page::new(vec![1], None).is_ok(), "L3: a last page");
    assert!(
        Page::new(Vec::<u8>::new(), None).is_ok(),
        "L3: an empty last page"
    );
    assert!(
        Page::new(vec![1], Some(Cursor::from_text("00"))).is_ok(),
        "L3: a page with a cursor"
    );
    expect_err!(
        Page::new(Vec::<u8>::new(), Some(Cursor::from_text("00"))),
        StateError::Invalid { .. },
        "L3: an empty page with a cursor"
    );

    for n in [0usize, 1, 2, 3, 4, 6, 7] {
        let t = unique("l3");
        let recs: Vec<RunRecord> = (0..n)
            .map(|i| RunRecord::new(RunKey::new(&t, format!("r{i}")), "planner"))
            .collect();
        let all = keys(&by_seq(create_many(s, recs)));
        for limit in [1, 2, 3, 1000] {
            let got = walk_runs_by(s, &StateQuery::new(&t), limit);
            assert_eq!(keys(&got), all, "L3: a walk of {n} runs, {limit} a page");
        }
        // A real cursor on an empty page is refused too.
        if n > 1 {
            let p = ok(
                s.list_runs(&StateQuery::new(&t), &PageRequest::new(1)),
                "L3: first page",
            );
            let cur = p.cursor().cloned().expect("more runs follow");
            expect_err!(
                Page::new(Vec::<RunRecord>::new(), Some(cur)),
                StateError::Invalid { .. },
                "L3: an empty page with a real cursor"
            );
        }
    }

    // Trays, marked trays and alarms.
    for n in [0usize, 3, 6] {
        let ns = unique("l3ns");
        let env = unique("l3env");
        let inst = InstanceKey::new(&ns, "i");
        let ops: Vec<TrayOp> = (0..n)
            .map(|i| TrayOp::Put {
                tray_ns: "t".into(),
                tray_id: format!("{i}"),
                tray: tray(true, vec![i as u8], &env),
            })
            .collect();
        ok(s.apply_batch(&inst, 1, ops), "L3: batch");
        let trays = walk("L3: list_trays", 3, |c| {
            s.list_trays(&inst, 1, &PageRequest::new(3).after(c))
        });
        assert_eq!(trays.len(), n, "L3: list_trays walks all {n} trays");
        let marked = walk("L3: marked_trays", 3, |c| {
            s.marked_trays(Some(&env), &PageRequest::new(3).after(c))
        });
        assert_eq!(
            marked.len(),
            n,
            "L3: marked_trays walks all {n} marked trays"
        );
        for i in 0..n {
            ok(
                s.set_alarm(&InstanceKey::new(&ns, format!("a{i}")), 1, 7),
                "L3: set_alarm",
            );
        }
        let due = due_of(s, 7, &ns, 3);
        assert_eq!(due.len(), n, "L3: due_alarms walks all {n} due alarms");
    }
}

/// L4: `updated_before` filters (strictly before); it never orders — the
/// listing stays in `seq` order whatever the times.
pub fn l4_updated_before_filters_never_orders(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("l4");
    // The clock goes back and forth: updated_at is not seq order.
    let mk = |id: &str, at: Millis, state: RunState| {
        c.clock.set(T0 + at);
        create(s, run_in(RunKey::new(&t, id), "planner", state)).key
    };
    let a = mk("a", 5_000, RunState::Pending);
    let b = mk("b", 3_000, RunState::Running);
    let cc = mk("c", 9_000, RunState::Pending);
    let d = mk("d", 1_000, RunState::Pending);
    let list = |before: Millis, limit: usize| {
        keys(&walk_runs_by(
            s,
            &StateQuery::new(&t).updated_before(before),
            limit,
        ))
    };
    for limit in [1, 2, 100] {
        assert_eq!(
            list(T0 + 5_000, limit),
            vec![b.clone(), d.clone()],
            "L4: before T0+5000, in seq order (not time order)"
        );
        assert_eq!(
            list(T0 + 5_001, limit),
            vec![a.clone(), b.clone(), d.clone()],
            "L4: before T0+5001"
        );
        assert_eq!(
            list(T0 + 1_000, limit),
            Vec::<RunKey>::new(),
            "L4: updated_before is strict"
        );
        assert_eq!(
            list(T0 + 1_001, limit),
            vec![d.clone()],
            "L4: before T0+1001"
        );
        assert_eq!(
            list(u64::MAX, limit),
            vec![a.clone(), b.clone(), cc.clone(), d.clone()],
            "L4: before the end of time"
        );
        assert_eq!(list(0, limit), Vec::<RunKey>::new(), "L4: before 0");
    }
    let q = StateQuery::new(&t)
        .state(RunState::Running)
        .updated_before(T0 + 5_000);
    assert_eq!(
        keys(&walk_runs(s, &q)),
        vec![b.clone()],
        "L4: with a state filter"
    );
    let q = StateQuery::new(&t)
        .state(RunState::Pending)
        .updated_before(T0 + 5_000);
    assert_eq!(
        keys(&walk_runs_by(s, &q, 1)),
        vec![d.clone()],
        "L4: with a state filter"
    );

    // A write moves updated_at, and with it the filter's answer; never the order.
    c.clock.set(T0 + 10_000);
    update(s, &b, |r| r.state = RunState::Paused);
    assert_eq!(
        list(T0 + 5_000, 1),
        vec![d.clone()],
        "L4: b was written after T0+5000"
    );
    c.clock.set(T0 + 500);
    ok(
        s.patch_run(
            &a,
            StateDelta {
                iterations: 1,
                ..Default::default()
            },
        ),
        "L4: patch",
    );
    assert_eq!(
        list(T0 + 1_000, 1),
        vec![a.clone()],
        "L4: a patch sets updated_at from the clock"
    );
    assert_eq!(
        list(T0 + 5_000, 1),
        vec![a.clone(), d.clone()],
        "L4: seq order, not time order"
    );
}

/// L5: `limit` is 1..=1000, default 100; pages hold `limit` items while
/// more follow; an indexed filter finds its few runs among many others.
pub fn l5_page_limit_and_default(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("l5");
    assert_eq!(PAGE_ITEMS_DEFAULT, 100, "L5: the default page is 100 items");
    assert_eq!(
        PageRequest::default().limit,
        100,
        "L5: PageRequest::default pages 100 at a time"
    );
    let recs: Vec<RunRecord> = (0..150)
        .map(|i| {
            let state = if i % 15 == 7 {
                RunState::Running
            } else {
                RunState::Completed
            };
            run_in(RunKey::new(&t, format!("r{i:03}")), "planner", state)
        })
        .collect();
    let all = by_seq(create_many(s, recs));
    let first = ok(
        s.list_runs(&StateQuery::new(&t), &PageRequest::default()),
        "L5: first page, default limit",
    );
    assert_eq!(
        first.items().len(),
        100,
        "L5: a default page holds 100 runs when more follow"
    );
    assert!(
        first.cursor().is_some(),
        "L5: 50 more runs follow the first page"
    );
    assert_eq!(
        keys(&walk_runs(s, &StateQuery::new(&t))),
        keys(&all),
        "L5: default-limit walk"
    );
    assert_eq!(
        keys(&walk_runs_by(s, &StateQuery::new(&t), PAGE_ITEMS_MAX)),
        keys(&all),
        "L5: a 1000-item page"
    );
    let running: Vec<RunKey> = all
        .iter()
        .filter(|r| r.state == RunState::Running)
        .map(|r| r.key.clone())
        .collect();
    assert_eq!(running.len(), 10, "L5: fixture");
    assert_eq!(
        keys(&walk_runs_by(
            s,
            &StateQuery::new(&t).state(RunState::Running),
            4
        )),
        running,
        "L5: a reaper's state query among finished runs"
    );
    let page = ok(
        s.list_runs(
            &StateQuery::new(&t).state(RunState::Running),
            &PageRequest::new(4),
        ),
        "L5: first reaper page",
    );
    assert_eq!(
        page.items().len(),
        4,
        "L5: a filtered page holds `limit` runs when more match"
    );
    for limit in [0, PAGE_ITEMS_MAX + 1] {
        let e = expect_err!(
            s.list_runs(&StateQuery::new(&t), &PageRequest::new(limit)),
            StateError::Invalid { .. },
            "L5: limit {limit}"
        );
        assert_names(&e, &["limit"], format_args!("L5: limit {limit}"));
    }
}

/// Calls a listing with a cursor it must refuse: `Invalid`, never a panic,
/// never a page (which could hold another tenant's data).
#[track_caller]
fn assert_refused<T: std::fmt::Debug>(ctx: impl Display, f: impl FnOnce() -> Result<Page<T>>) {
    match caught(f) {
        Err(p) => {
            panic!("{ctx}: the store panicked ({p}) — L6: a bad cursor is Invalid, never a panic")
        }
        Ok(Ok(page)) => panic!(
            "{ctx}: accepted (a page of {} items: {:?}) — L6: a cursor of another tenant, filter or listing, or an altered one, is Invalid",
            page.items().len(),
            page.items().iter().take(3).collect::<Vec<_>>()
        ),
        Ok(Err(StateError::Invalid { .. })) => {}
        Ok(Err(e)) => panic!("{ctx}: expected Invalid, got {e:?}"),
    }
}

/// Altered versions of a cursor's text: every character replaced in turn
/// by every character of the base64url and base64 alphabets and a few
/// others (case changes, `+`, `/`, `=`, space, non-ASCII), every
/// truncation, extensions, and garbage.
fn tampered(c: &Cursor) -> Vec<(String, Cursor)> {
    let chars: Vec<char> = c.as_str().chars().collect();
    let text = |cs: &[char]| cs.iter().collect::<String>();
    let alphabet: Vec<char> = ('A'..='Z')
        .chain('a'..='z')
        .chain('0'..='9')
        .chain("-_+/=. %\0\né".chars())
        .collect();
    let mut out = Vec::new();
    for i in 0..chars.len() {
        for &r in &alphabet {
            if r != chars[i] {
                let mut cs = chars.clone();
                cs[i] = r;
                out.push((format!("char {i} set to {r:?}"), text(&cs)));
            }
        }
    }
    let n = chars.len();
    for k in 0..n {
        out.push((format!("cut to {k} chars"), text(&chars[..k])));
        out.push((format!("first {k} chars cut"), text(&chars[k..])));
    }
    let whole = c.as_str();
    for (what, t) in [
        ("a char added", format!("{whole}A")),
        ("a 0 added", format!("{whole}0")),
        ("two chars added", format!("{whole}AA")),
        ("four chars added", format!("{whole}AAAA")),
        ("a char put before", format!("A{whole}")),
        ("padding added", format!("{whole}=")),
        ("padding added twice", format!("{whole}==")),
        ("a newline added", format!("{whole}\n")),
        ("doubled", format!("{whole}{whole}")),
        ("upper case", whole.to_uppercase()),
        ("lower case", whole.to_lowercase()),
        (
            "standard alphabet",
            whole.replace('-', "+").replace('_', "/"),
        ),
        ("empty", String::new()),
        ("a space", " ".into()),
        ("padded", format!(" {whole} ")),
        ("garbage", "not a cursor".into()),
        ("non-hex", "zz".repeat(20)),
        ("non-ASCII", "é☃".repeat(10)),
        ("a NUL", "\0".into()),
        ("zeros", "0".repeat(64)),
        ("fs", "f".repeat(64)),
        ("JSON", "{}".into()),
        ("huge", "ab".repeat(100_000)),
    ] {
        out.push((what.to_string(), t));
    }
    out.into_iter()
        .filter(|(_, t)| t != whole)
        .map(|(w, t)| (w, Cursor::from_text(t)))
        .collect()
}

/// L6: a cursor shows nothing of its tenant (or of any name bound into
/// it) in any encoding: not as text, not as hex (either case), not as
/// base64 or base64url at any alignment, not in the bytes its text
/// decodes to.
#[track_caller]
fn assert_hides(what: &str, c: &Cursor, names: &[&str]) {
    let text = c.as_str();
    for name in names {
        let hex: String = name.bytes().map(|b| format!("{b:02x}")).collect();
        let spellings = [name.to_string(), hex.clone(), hex.to_uppercase()];
        for sp in &spellings {
            assert!(
                !text.contains(sp.as_str()) && !text.to_lowercase().contains(&sp.to_lowercase()),
                "L6: {what} {text:?} shows {name:?} (as {sp:?}): a cursor is opaque"
            );
        }
        // Base64 at every alignment: decode the text from each of the
        // first four characters (either alphabet) and look for the bytes.
        for skip in 0..4 {
            let tail: Vec<u8> = text.bytes().skip(skip).collect();
            let decoded = base64_any(&tail);
            assert!(
                !decoded.windows(name.len()).any(|w| w == name.as_bytes()),
                "L6: {what} {text:?} holds {name:?} in base64: a cursor is opaque"
            );
        }
    }
}

/// Lenient base64 (standard and url alphabets, no padding): the bytes
/// that whole groups of four known characters decode to.
fn base64_any(text: &[u8]) -> Vec<u8> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' | b'+' => 62,
            b'_' | b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::new();
    for g in text.chunks_exact(4) {
        let Some(v) = g
            .iter()
            .try_fold(0u32, |acc, &c| val(c).map(|x| acc << 6 | x))
        else {
            out.push(0); // a break: no name spans it
            continue;
        };
        out.extend_from_slice(&v.to_be_bytes()[1..]);
    }
    out
}

/// L7: a cursor carries its walk's filters. A next page that names only
/// the tenant and the cursor (the seeds' paging loop) continues the same
/// filtered walk, for every filter and their combinations; the same
/// cursor with other filters or another tenant stays `Invalid` (L6).
pub fn l7_cursor_carries_its_walks_filters(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let (ta, tb) = (unique("l7a"), unique("l7b"));
    for t in [&ta, &tb] {
        create_session(s, &SessionKey::new(t, "sa"));
        create_session(s, &SessionKey::new(t, "sb"));
    }
    // 24 runs of A: two sessions, two agents, three states, and updated
    // at two moments; tenant B gets the same ids.
    for t in [&ta, &tb] {
        let recs: Vec<RunRecord> = (0..24)
            .map(|i| {
                RunRecord::new(
                    RunKey::new(t, format!("r{i:02}")),
                    ["planner", "coder"][i % 2],
                )
                .with_session(["sa", "sb"][(i / 2) % 2])
            })
            .collect();
        create_many(s, recs);
    }
    c.clock.advance(1_000);
    let cut = agentstate_core::Clock::now_millis(&*c.clock);
    for i in 0..24 {
        let key = RunKey::new(&ta, format!("r{i:02}"));
        if i % 3 == 0 {
            continue;
        }
        let mut r = ok(s.get_run(&key), "L7: read").expect("L7: created");
        r.state = [RunState::Running, RunState::Completed][i % 3 - 1];
        ok(s.put_run(r), "L7: move a run");
    }
    c.clock.advance(1_000);
    let filters = [
        StateQuery::new(&ta).state(RunState::Running),
        StateQuery::new(&ta).state(RunState::Completed),
        StateQuery::new(&ta).session("sb"),
        StateQuery::new(&ta).agent("coder"),
        StateQuery::new(&ta).updated_before(cut),
        StateQuery::new(&ta).session("sa").state(RunState::Running),
        StateQuery::new(&ta)
            .agent("planner")
            .state(RunState::Pending)
            .updated_before(cut),
        StateQuery::new(&ta),
    ];
    for q in &filters {
        // The walk that repeats its filters on every page…
        let expected = walk_runs_by(s, q, 2);
        // …and the seeds' loop: the filters on the first page only.
        let mut seen = Vec::new();
        let mut page = ok(s.list_runs(q, &PageRequest::new(2)), "L7: first page");
        let mut pages = 1;
        loop {
            seen.extend(keys(page.items()));
            let Some(cur) = page.cursor().cloned() else {
                break;
            };
            // A bare tenant query with another tenant is refused.
            assert_refused(
                format_args!("L7: {q:?}'s cursor with only tenant B"),
                || {
                    s.list_runs(
                        &StateQuery::new(&tb),
                        &PageRequest::new(2).after(Some(&cur)),
                    )
                },
            );
            // Other filters with the cursor are refused (L6), unless they
            // are the walk's own.
            let other = if q.agent.as_deref() == Some("coder") {
                StateQuery::new(&ta).agent("planner")
            } else {
                StateQuery::new(&ta).agent("coder")
            };
            assert_refused(format_args!("L7: {q:?}'s cursor with {other:?}"), || {
                s.list_runs(&other, &PageRequest::new(2).after(Some(&cur)))
            });
            let same = ok(
                s.list_runs(q, &PageRequest::new(2).after(Some(&cur))),
                "L7: the cursor with its own filters repeated",
            );
            page = ok(
                s.list_runs(
                    &StateQuery::new(&ta),
                    &PageRequest::new(2).after(Some(&cur)),
                ),
                "L7: the cursor with only its tenant continues its walk",
            );
            assert_eq!(
                keys(same.items()),
                keys(page.items()),
                "L7: {q:?}: a bare next page and one repeating the filters differ"
            );
            pages += 1;
            assert!(pages <= 30, "L7: {q:?}: the walk does not end");
        }
        assert_eq!(
            seen,
            keys(&expected),
            "L7: {q:?}: the walk with the filters on its first page only visits other runs"
        );
        assert!(
            !seen.is_empty(),
            "L7: {q:?} matches runs, so the test walks something"
        );
    }
}

/// L6: a cursor is opaque and bound to its listing, tenant and filters;
/// with another tenant, other filters, another listing, or altered, it is
/// `Invalid` — never a panic, never another tenant's data.
pub fn l6_cursor_bound_to_listing_and_untampered(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let (ta, tb) = (unique("l6a"), unique("l6b"));
    for t in [&ta, &tb] {
        create_session(s, &SessionKey::new(t, "sa"));
        create_session(s, &SessionKey::new(t, "sb"));
        let recs: Vec<RunRecord> = (0..10)
            .map(|i| {
                RunRecord::new(RunKey::new(t, format!("r{i}")), "planner")
                    .with_session(["sa", "sb"][i % 2])
            })
            .collect();
        create_many(s, recs);
    }
    let qa = StateQuery::new(&ta);
    // A page request of `limit` runs after `c`.
    let after = |limit: usize, c: &Cursor| PageRequest::new(limit).after(Some(c));
    let first = ok(
        s.list_runs(&qa, &PageRequest::new(3)),
        "L6: first page of tenant A",
    );
    let cur = first
        .cursor()
        .cloned()
        .expect("L6: more runs follow the first page");
    let rest = ok(
        s.list_runs(&qa, &after(3, &cur)),
        "L6: the cursor continues its own listing",
    );
    let all_a = walk_runs_by(s, &qa, 3);
    assert_eq!(
        keys(rest.items()),
        keys(&all_a[3..all_a.len().min(6)]),
        "L6: a cursor continues its listing where the page ended"
    );

    // Other tenant, other filters.
    let others = [
        ("tenant B", StateQuery::new(&tb)),
        (
            "a state filter",
            StateQuery::new(&ta).state(RunState::Pending),
        ),
        ("an agent filter", StateQuery::new(&ta).agent("planner")),
        ("a session filter", StateQuery::new(&ta).session("sa")),
        (
            "an updated_before filter",
            StateQuery::new(&ta).updated_before(u64::MAX),
        ),
    ];
    for (what, q) in &others {
        assert_refused(format_args!("L6: tenant A's cursor with {what}"), || {
            s.list_runs(q, &after(3, &cur))
        });
    }
    let filtered = StateQuery::new(&ta).state(RunState::Pending);
    let fcur = ok(
        s.list_runs(&filtered, &PageRequest::new(2)),
        "L6: filtered first page",
    )
    .cursor()
    .cloned()
    .expect("L6: more follow");
    // (The same tenant with no filter continues the walk: L7.)
    for (what, q) in [
        (
            "another state",
            StateQuery::new(&ta).state(RunState::Running),
        ),
        ("tenant B", StateQuery::new(&tb).state(RunState::Pending)),
    ] {
        assert_refused(
            format_args!("L6: a state-filtered cursor with {what}"),
            || s.list_runs(&q, &after(2, &fcur)),
        );
    }
    let scur = ok(
        s.list_runs(&StateQuery::new(&ta).session("sa"), &PageRequest::new(2)),
        "L6: session page",
    )
    .cursor()
    .cloned()
    .expect("L6: more follow");
    for (what, q) in [
        ("another session", StateQuery::new(&ta).session("sb")),
        (
            "a session and a state",
            StateQuery::new(&ta).session("sa").state(RunState::Pending),
        ),
        (
            "tenant B's same session",
            StateQuery::new(&tb).session("sa"),
        ),
    ] {
        assert_refused(format_args!("L6: a session cursor with {what}"), || {
            s.list_runs(&q, &after(2, &scur))
        });
    }

    // Trays, marked trays, alarms.
    let ns = unique("l6ns");
    let (env1, env2) = (unique("l6e1"), unique("l6e2"));
    let (i1, i2, i3) = (
        InstanceKey::new(&ns, "i1"),
        InstanceKey::new(&ns, "i2"),
        InstanceKey::new(&ns, "i3"),
    );
    for i in [&i1, &i2] {
        let ops = (0..6)
            .map(|n| TrayOp::Put {
                tray_ns: "t".into(),
                tray_id: format!("{n}"),
                tray: tray(false, "d", &env1),
            })
            .collect();
        ok(s.apply_batch(i, 1, ops), "L6: batch");
    }
    let ops = (0..12)
        .map(|n| TrayOp::Put {
            tray_ns: "m".into(),
            tray_id: format!("{n}"),
            tray: tray(true, "d", [&env1, &env2][n % 2]),
        })
        .collect();
    ok(s.apply_batch(&i3, 1, ops), "L6: marked batch");
    for n in 0..6 {
        ok(
            s.set_alarm(&InstanceKey::new(&ns, format!("alarm-{n}")), 1, 10 + n),
            "L6: set_alarm",
        );
    }
    let tcur = ok(s.list_trays(&i1, 1, &PageRequest::new(2)), "L6: list_trays")
        .cursor()
        .cloned()
        .expect("L6: more trays follow");
    let mcur = ok(
        s.marked_trays(Some(&env1), &PageRequest::new(2)),
        "L6: marked_trays",
    )
    .cursor()
    .cloned()
    .expect("L6: more marked follow");
    let ncur = ok(
        s.marked_trays(None, &PageRequest::new(2)),
        "L6: marked_trays(None)",
    )
    .cursor()
    .cloned()
    .expect("L6: more marked follow");
    let acur = ok(s.due_alarms(20, &PageRequest::new(2)), "L6: due_alarms")
        .cursor()
        .cloned()
        .expect("L6: more alarms follow");
    ok(
        s.list_trays(&i1, 1, &PageRequest::new(2).after(Some(&tcur))),
        "L6: a trays cursor continues its listing",
    );
    ok(
        s.marked_trays(Some(&env1), &PageRequest::new(2).after(Some(&mcur))),
        "L6: a marked cursor continues its listing",
    );
    ok(
        s.due_alarms(20, &PageRequest::new(2).after(Some(&acur))),
        "L6: an alarms cursor continues its listing",
    );

    assert_refused("L6: instance i1's trays cursor with i2", || {
        s.list_trays(&i2, 1, &PageRequest::new(2).after(Some(&tcur)))
    });
    assert_refused("L6: env1's marked cursor with env2", || {
        s.marked_trays(Some(&env2), &PageRequest::new(2).after(Some(&mcur)))
    });
    assert_refused("L6: env1's marked cursor with every env", || {
        s.marked_trays(None, &PageRequest::new(2).after(Some(&mcur)))
    });
    assert_refused("L6: an every-env marked cursor with env1", || {
        s.marked_trays(Some(&env1), &PageRequest::new(2).after(Some(&ncur)))
    });
    // Another listing.
    assert_refused("L6: a runs cursor on list_trays", || {
        s.list_trays(&i1, 1, &PageRequest::new(2).after(Some(&cur)))
    });
    assert_refused("L6: a runs cursor on marked_trays", || {
        s.marked_trays(None, &PageRequest::new(2).after(Some(&cur)))
    });
    assert_refused("L6: a runs cursor on due_alarms", || {
        s.due_alarms(20, &PageRequest::new(2).after(Some(&cur)))
    });
    assert_refused("L6: a trays cursor on list_runs", || {
        s.list_runs(&qa, &after(3, &tcur))
    });
    assert_refused("L6: a marked cursor on due_alarms", || {
        s.due_alarms(20, &PageRequest::new(2).after(Some(&mcur)))
    });
    assert_refused("L6: an alarms cursor on marked_trays", || {
        s.marked_trays(Some(&env1), &PageRequest::new(2).after(Some(&acur)))
    });
    assert_refused("L6: an alarms cursor on list_runs", || {
        s.list_runs(&qa, &after(3, &acur))
    });

    let secur = ok(
        s.list_sessions(&ta, &PageRequest::new(1)),
        "L6: list_sessions",
    )
    .cursor()
    .cloned()
    .expect("L6: more sessions follow");
    let xcur = ok(s.export_page(&PageRequest::new(2)), "L6: export_page")
        .cursor()
        .cloned()
        .expect("L6: more entries follow");
    ok(
        s.list_sessions(&ta, &PageRequest::new(1).after(Some(&secur))),
        "L6: a sessions cursor continues its listing",
    );
    assert_refused("L6: tenant A's sessions cursor with tenant B", || {
        s.list_sessions(&tb, &PageRequest::new(1).after(Some(&secur)))
    });
    assert_refused("L6: a sessions cursor on list_runs", || {
        s.list_runs(&qa, &after(3, &secur))
    });
    assert_refused("L6: an export cursor on list_sessions", || {
        s.list_sessions(&ta, &PageRequest::new(1).after(Some(&xcur)))
    });
    assert_refused("L6: a runs cursor on export_page", || {
        s.export_page(&PageRequest::new(2).after(Some(&cur)))
    });

    // Opaque: no cursor shows its tenant, instance or env.
    for (what, c, names) in [
        ("runs cursor", &cur, vec![ta.as_str()]),
        ("state-filtered cursor", &fcur, vec![ta.as_str()]),
        ("session cursor", &scur, vec![ta.as_str()]),
        ("trays cursor", &tcur, vec![ns.as_str()]),
        ("marked cursor", &mcur, vec![env1.as_str(), ns.as_str()]),
        ("every-env marked cursor", &ncur, vec![ns.as_str()]),
        ("sessions cursor", &secur, vec![ta.as_str()]),
    ] {
        assert_hides(what, c, &names);
    }

    // Altered cursors, on every listing.
    for (what, bad) in tampered(&cur) {
        assert_refused(format_args!("L6: runs cursor, {what}"), || {
            s.list_runs(&qa, &after(3, &bad))
        });
        assert_refused(format_args!("L6: runs cursor, {what}, tenant B"), || {
            s.list_runs(&StateQuery::new(&tb), &after(3, &bad))
        });
    }
    for (what, bad) in tampered(&tcur) {
        assert_refused(format_args!("L6: trays cursor, {what}"), || {
            s.list_trays(&i1, 1, &PageRequest::new(2).after(Some(&bad)))
        });
    }
    for (what, bad) in tampered(&mcur) {
        assert_refused(format_args!("L6: marked cursor, {what}"), || {
            s.marked_trays(Some(&env1), &PageRequest::new(2).after(Some(&bad)))
        });
    }
    for (what, bad) in tampered(&acur) {
        assert_refused(format_args!("L6: alarms cursor, {what}"), || {
            s.due_alarms(20, &PageRequest::new(2).after(Some(&bad)))
        });
    }
    for (what, bad) in tampered(&secur) {
        assert_refused(format_args!("L6: sessions cursor, {what}"), || {
            s.list_sessions(&ta, &PageRequest::new(1).after(Some(&bad)))
        });
    }
    for (what, bad) in tampered(&xcur) {
        assert_refused(format_args!("L6: export cursor, {what}"), || {
            s.export_page(&PageRequest::new(2).after(Some(&bad)))
        });
    }
    // Nothing above moved anything.
    assert_eq!(
        walk_runs_by(s, &qa, 3),
        all_a,
        "L6/E6: refused cursors changed tenant A's runs"
    );
    assert_eq!(
        epoch_of(s, &i1),
        1,
        "L6/E6: a refused trays cursor moved the epoch"
    );
}
