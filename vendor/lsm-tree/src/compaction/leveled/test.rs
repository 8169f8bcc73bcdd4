use super::*;
use crate::{AbstractTree, Config, SequenceNumberCounter};
use std::sync::Arc;
use test_log::test;

#[test]
fn leveled_empty_levels() -> crate::Result<()> {
    let dir = tempfile::tempdir()?;
    let tree = Config::new(
        dir.path(),
        SequenceNumberCounter::default(),
        SequenceNumberCounter::default(),
    )
    .open()?;

    let strategy = Arc::new(Strategy::default());
    tree.compact(strategy, 0)?;

    assert_eq!(0, tree.table_count());
    Ok(())
}

#[test]
fn leveled_l0_below_limit() -> crate::Result<()> {
    let dir = tempfile::tempdir()?;
    let tree = Config::new(
        dir.path(),
        SequenceNumberCounter::default(),
        SequenceNumberCounter::default(),
    )
    .open()?;

    for i in 0..3u8 {
        tree.insert([b'k', i].as_slice(), "v", 0);
        tree.flush_active_memtable(0)?;
    }

    let before = tree.table_count();
    assert_eq!(3, before);

    let strategy = Arc::new(Strategy::default());
    tree.compact(strategy, 0)?;

    assert_eq!(before, tree.table_count());

    Ok(())
}

#[test]
fn leveled_l0_reached_limit() -> crate::Result<()> {
    let dir = tempfile::tempdir()?;
    let tree = Config::new(
        dir.path(),
        SequenceNumberCounter::default(),
        SequenceNumberCounter::default(),
    )
    .open()?;

    for i in 0..4u8 {
        // NOTE: Tables need to overlap
        tree.insert("a", "v", 0);
        tree.insert([b'k', i].as_slice(), "v", 0);
        tree.insert("z", "v", 0);
        tree.flush_active_memtable(0)?;
    }

    assert_eq!(4, tree.table_count());

    let strategy = Arc::new(Strategy::default());
    tree.compact(strategy, 0)?;

    assert_eq!(1, tree.table_count());

    Ok(())
}

#[test]
fn leveled_l0_reached_limit_disjoint() -> crate::Result<()> {
    let dir = tempfile::tempdir()?;
    let tree = Config::new(
        dir.path(),
        SequenceNumberCounter::default(),
        SequenceNumberCounter::default(),
    )
    .open()?;

    for i in 0..4u8 {
        tree.insert([b'k', i].as_slice(), "v", 0);
        tree.flush_active_memtable(0)?;
    }

    assert_eq!(4, tree.table_count());

    let strategy = Arc::new(Strategy::default());
    tree.compact(strategy, 0)?;

    assert_eq!(4, tree.table_count());

    Ok(())
}

#[test]
fn leveled_l0_reached_limit_disjoint_l1() -> crate::Result<()> {
    let dir = tempfile::tempdir()?;
    let tree = Config::new(
        dir.path(),
        SequenceNumberCounter::default(),
        SequenceNumberCounter::default(),
    )
    .open()?;

    for i in 0..4 {
        // NOTE: Tables need to overlap
        tree.insert("a", "v", i);
        tree.insert("b", "v", i);
        tree.flush_active_memtable(0)?;
    }

    let fifo = Arc::new(Strategy::default());
    tree.compact(fifo, 0)?;

    assert_eq!(1, tree.table_count());

    for i in 0..4u8 {
        tree.insert([b'k', i].as_slice(), "v", 0);
        tree.flush_active_memtable(0)?;
    }

    assert_eq!(5, tree.table_count());

    let strategy = Arc::new(Strategy::default());
    tree.compact(strategy, 0)?;

    assert_eq!(5, tree.table_count());

    Ok(())
}

#[test]
#[expect(clippy::unwrap_used)]
fn leveled_sequential_inserts() -> crate::Result<()> {
    let dir = tempfile::tempdir()?;
    let tree = Config::new(
        dir.path(),
        SequenceNumberCounter::default(),
        SequenceNumberCounter::default(),
    )
    .open()?;

    let strategy = Arc::new(Strategy {
        target_size: 1,
        ..Default::default()
    });

    let mut table_count = 0;

    for k in 0u64..100 {
        table_count += 1;

        tree.insert(k.to_be_bytes(), "", 0);
        tree.flush_active_memtable(0)?;

        assert_eq!(table_count, tree.table_count());
        tree.compact(strategy.clone(), 0)?;
        assert_eq!(table_count, tree.table_count());

        for idx in 1..=5 {
            assert_eq!(
                0,
                tree.current_version().level(idx).unwrap().len(),
                "no tables should be in intermediary level (L{idx})",
            );
        }
    }

    Ok(())
}

/// agentstate patch: a level whose table reaches past the key range of
/// the level below still moves down (`pick_overlapping_merge`). With an
/// L1 set small (`with_level_base_size`), an L0 merge's output spans
/// every key the memtables held, and the bottom level may hold a
/// narrower range; no window of the bottom level contains it.
#[test]
#[expect(clippy::unwrap_used)]
fn leveled_level_wider_than_the_next_moves_down() -> crate::Result<()> {
    let dir = tempfile::tempdir()?;
    let tree = Config::new(
        dir.path(),
        SequenceNumberCounter::default(),
        SequenceNumberCounter::default(),
    )
    .open()?;

    let strategy = Arc::new(Strategy::default().with_level_base_size(1));
    let level_len = |idx: usize| tree.current_version().level(idx).unwrap().len();

    // A narrow bottom level: keys m0..m9, moved to Lmax whole.
    for i in 0..10u8 {
        tree.insert([b'm', b'0' + i].as_slice(), "v", 0);
    }
    tree.flush_active_memtable(0)?;
    tree.compact(strategy.clone(), 0)?;
    assert_eq!(1, level_len(6), "the first table moves to the last level");

    // Four overlapping L0 tables over a..z: merged into L5, the first
    // level now (L6 is over the base), as one table wider than L6's.
    for i in 0..4u8 {
        tree.insert("a", "v", 1);
        tree.insert([b'k', b'0' + i].as_slice(), "v", 1);
        tree.insert("z", "v", 1);
        tree.flush_active_memtable(0)?;
    }
    tree.compact(strategy.clone(), 0)?;
    assert_eq!(0, level_len(0));
    assert_eq!(1, level_len(5), "L0 is merged into L5");

    // L5 is over its target: merged with L6's overlapping table.
    tree.compact(strategy, 0)?;
    assert_eq!(0, level_len(5), "L5 moves down although L6 is narrower");
    assert_eq!(1, level_len(6));

    for key in [&b"a"[..], b"z", b"k3", b"m0", b"m9"] {
        assert!(tree.get(key, crate::SeqNo::MAX)?.is_some(), "{key:?}");
    }

    Ok(())
}

/// agentstate patch: `compaction_due` answers whether `compact` would
/// change the tree, without changing it.
#[test]
fn compaction_due_says_whether_compact_would_change_the_tree() -> crate::Result<()> {
    let dir = tempfile::tempdir()?;
    let tree = Config::new(
        dir.path(),
        SequenceNumberCounter::default(),
        SequenceNumberCounter::default(),
    )
    .open()?;
    let strategy = Arc::new(Strategy::default());
    let layout = |tree: &crate::AnyTree| -> Vec<Vec<TableId>> {
        (0..7)
            .map(|l| {
                tree.current_version()
                    .level(l)
                    .map(|level| {
                        level
                            .iter()
                            .flat_map(|run| run.iter().map(Table::id))
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .collect()
    };
    let (mut due_seen, mut idle_seen) = (0, 0);
    for round in 0..12u8 {
        // Two overlapping tables a round, so L0 reaches its threshold
        // and what was merged moves on down.
        for _ in 0..2 {
            tree.insert("a", "v", 0);
            tree.insert([b'k', round].as_slice(), "v", 0);
            tree.insert("z", "v", 0);
            tree.flush_active_memtable(0)?;
        }
        loop {
            let before = layout(&tree);
            let due = tree.compaction_due(&*strategy);
            assert_eq!(before, layout(&tree), "asking changed nothing");
            tree.compact(strategy.clone(), 0)?;
            let changed = layout(&tree) != before;
            assert_eq!(due, changed, "round {round}: due {due}, layout {before:?}");
            if due {
                due_seen += 1;
            } else {
                idle_seen += 1;
                break;
            }
        }
    }
    assert!(
        due_seen > 0 && idle_seen > 0,
        "{due_seen} due, {idle_seen} idle"
    );
    Ok(())
}
