// Copyright (c) 2024-present, fjall-rs
// This source code is licensed under both the Apache 2.0 and MIT License
// (found in the LICENSE-* files in the repository)

use crate::{
    memtable::Memtable,
    tree::sealed::SealedMemtables,
    version::{persist_version, Version},
    SeqNo, SequenceNumberCounter,
};
use std::{
    collections::VecDeque,
    path::Path,
    sync::{Arc, RwLock},
};

/// A super version is a point-in-time snapshot of memtables and a [`Version`] (list of disk files)
#[derive(Clone)]
pub struct SuperVersion {
    /// Active memtable that is being written to
    #[doc(hidden)]
    pub active_memtable: Arc<Memtable>,

    /// Frozen memtables that are being flushed
    pub(crate) sealed_memtables: Arc<SealedMemtables>,

    /// Current tree version
    pub(crate) version: Version,

    pub(crate) seqno: SeqNo,
}

pub struct SuperVersions(VecDeque<SuperVersion>);

/// agentstate patch: versions taken out of the history by
/// `SuperVersions::maintenance`, with their files, let go of after the
/// history's lock is released: `finish` removes the files (a version file
/// already gone is not an error) and drops the versions; dropping it does
/// the same, ignoring errors.
#[derive(Default)]
#[must_use = "call `finish` once the version history's lock is released"]
pub struct Retired {
    files: Vec<std::path::PathBuf>,
    versions: Vec<SuperVersion>,
}

impl Retired {
    /// Removes the retired version files, then drops the versions (the
    /// last references to tables no version holds delete their files).
    pub fn finish(mut self) -> crate::Result<()> {
        let mut result = Ok(());
        for path in std::mem::take(&mut self.files) {
            match crate::file::retry_transient_io(|| std::fs::remove_file(&path)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    if result.is_ok() {
                        result = Err(e.into());
                    }
                }
            }
        }
        self.versions.clear();
        result
    }
}

impl Drop for Retired {
    fn drop(&mut self) {
        for path in &self.files {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl SuperVersions {
    pub fn new(version: Version) -> Self {
        Self(
            vec![SuperVersion {
                active_memtable: Arc::new(Memtable::new(0)),
                sealed_memtables: Arc::default(),
                version,
                seqno: 0,
            }]
            .into(),
        )
    }

    pub fn memtable_size_sum(&self) -> u64 {
        let mut set = crate::HashMap::default();

        for super_version in &self.0 {
            set.entry(super_version.active_memtable.id)
                .and_modify(|bytes| *bytes += super_version.active_memtable.size())
                .or_insert_with(|| super_version.active_memtable.size());

            for sealed in super_version.sealed_memtables.iter() {
                set.entry(sealed.id)
                    .and_modify(|bytes| *bytes += sealed.size())
                    .or_insert_with(|| sealed.size());
            }
        }

        set.into_values().sum()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn free_list_len(&self) -> usize {
        self.len().saturating_sub(1)
    }

    /// agentstate patch: takes the versions no snapshot can read any more
    /// out of the history and returns them with their files, to be let go
    /// of by `Retired::finish` once the caller has released the lock.
    /// Removing the version files here, and dropping the last references
    /// to the tables an older version held (which deletes their files),
    /// ran under the version history's write lock, which every read and
    /// every memtable insert of the tree waits for.
    pub fn maintenance(&mut self, folder: &Path, gc_watermark: SeqNo) -> Retired {
        let mut retired = Retired::default();

        if gc_watermark == 0 {
            return retired;
        }

        if self.free_list_len() < 1 {
            return retired;
        }

        log::trace!("Running manifest GC with watermark={gc_watermark}");

        if let Some(hi_idx) = self.0.iter().rposition(|x| x.seqno < gc_watermark) {
            for _ in 0..hi_idx {
                let Some(head) = self.0.pop_front() else {
                    break;
                };

                log::trace!(
                    "Removing version #{} (seqno={})",
                    head.version.id(),
                    head.seqno,
                );

                retired
                    .files
                    .push(folder.join(format!("v{}", head.version.id())));
                retired.versions.push(head);
            }
        }

        log::trace!("Manifest GC done, version length now {}", self.0.len());

        retired
    }

    /// Modifies the level manifest atomically.
    ///
    /// The function accepts a transition function that receives the current version
    /// and returns a new version.
    ///
    /// The function takes care of persisting the version changes on disk.
    pub(crate) fn upgrade_version<F: FnOnce(&SuperVersion) -> crate::Result<SuperVersion>>(
        &mut self,
        tree_path: &Path,
        f: F,
        seqno: &SequenceNumberCounter,
        visible_seqno: &SequenceNumberCounter,
    ) -> crate::Result<()> {
        self.upgrade_version_with_seqno(tree_path, f, seqno.next(), visible_seqno)
    }

    /// Like `upgrade_version`, but takes an already-allocated sequence number.
    ///
    /// This is useful when the seqno must be coordinated with other operations
    /// (e.g., bulk ingestion where tables are recovered with the same seqno).
    pub(crate) fn upgrade_version_with_seqno<
        F: FnOnce(&SuperVersion) -> crate::Result<SuperVersion>,
    >(
        &mut self,
        tree_path: &Path,
        f: F,
        seqno: SeqNo,
        visible_seqno: &SequenceNumberCounter,
    ) -> crate::Result<()> {
        let mut next_version = f(&self.latest_version())?;
        next_version.seqno = seqno;
        log::trace!("Next version seqno={}", next_version.seqno);

        persist_version(tree_path, &next_version.version)?;
        self.append_version(next_version);

        visible_seqno.fetch_max(seqno + 1);

        Ok(())
    }

    /// agentstate patch: installs the next version like `upgrade_version`,
    /// but with the write lock held only to publish it, not while its file
    /// is written and synced. `upgrade_version` runs with the caller's
    /// write guard, so every read and every memtable insert of the tree
    /// (both take the read lock) waited for the version file's syncs: a
    /// flush and each compaction stalled them for milliseconds.
    ///
    /// The caller must hold the tree's compaction state lock, which every
    /// change of the persisted `version` takes (flush registration,
    /// compaction, ingestion, `clear`), so the version `f` sees stays the
    /// latest until it is published. What may change meanwhile is the
    /// memtables (a writer's rotation seals the active one): the published
    /// super version takes them from the latest one, less the sealed
    /// memtables `f` released. So `f` may change `version` and release
    /// sealed memtables, nothing else.
    ///
    /// `maintenance` with `gc_watermark` follows in the same critical
    /// section; the versions it retires are returned, for the caller to
    /// `finish` (the lock is released by then).
    pub(crate) fn upgrade_version_unblocked<F>(
        history: &RwLock<Self>,
        tree_path: &Path,
        f: F,
        seqno: &SequenceNumberCounter,
        visible_seqno: &SequenceNumberCounter,
        gc_watermark: SeqNo,
    ) -> crate::Result<Retired>
    where
        F: FnOnce(&SuperVersion) -> crate::Result<SuperVersion>,
    {
        #[expect(clippy::expect_used, reason = "lock is expected to not be poisoned")]
        let base = history.read().expect("lock is poisoned").latest_version();

        let mut next = f(&base)?;
        next.seqno = seqno.next();
        log::trace!("Next version seqno={}", next.seqno);

        persist_version(tree_path, &next.version)?;

        #[expect(clippy::expect_used, reason = "lock is expected to not be poisoned")]
        let mut lock = history.write().expect("lock is poisoned");
        let latest = lock.latest_version();

        if latest.version.id() != base.version.id() {
            // Cannot happen while every version change holds the
            // compaction state lock; never publish over a version that
            // changed underneath (the one on disk is now ours).
            log::error!(
                "Version changed while version {} was persisted (now {})",
                next.version.id(),
                latest.version.id(),
            );
            return Err(crate::Error::Unrecoverable);
        }

        let mut sealed = latest.sealed_memtables;
        for released in base
            .sealed_memtables
            .iter()
            .filter(|mt| !next.sealed_memtables.contains(&mt.id))
        {
            sealed = Arc::new(sealed.remove(released.id));
        }
        next.sealed_memtables = sealed;
        next.active_memtable = latest.active_memtable;

        let published = next.seqno;
        lock.append_version(next);
        visible_seqno.fetch_max(published + 1);

        Ok(lock.maintenance(tree_path, gc_watermark))
    }

    pub fn append_version(&mut self, version: SuperVersion) {
        self.0.push_back(version);
    }

    pub fn replace_latest_version(&mut self, version: SuperVersion) {
        if self.0.pop_back().is_some() {
            self.0.push_back(version);
        }
    }

    pub fn latest_version(&self) -> SuperVersion {
        #[expect(clippy::expect_used, reason = "SuperVersion is expected to exist")]
        self.0
            .iter()
            .last()
            .cloned()
            .expect("should always have a SuperVersion")
    }

    pub fn get_version_for_snapshot(&self, seqno: SeqNo) -> SuperVersion {
        if seqno == 0 {
            #[expect(clippy::expect_used, reason = "SuperVersion is expected to exist")]
            return self
                .0
                .front()
                .cloned()
                .expect("should always find a SuperVersion");
        }

        let version = self
            .0
            .iter()
            .rev()
            .find(|version| version.seqno < seqno)
            .cloned();

        if version.is_none() {
            log::error!("Failed to find a SuperVersion for snapshot with seqno={seqno}");
            log::error!("SuperVersions:");

            for version in self.0.iter().rev() {
                log::error!("-> {}, seqno={}", version.version.id(), version.seqno);
            }
        }

        #[expect(clippy::expect_used, reason = "SuperVersion is expected to exist")]
        version.expect("should always find a SuperVersion")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_log::test;

    fn one_version(id: crate::version::VersionId, active: u64, sealed: &[u64]) -> SuperVersion {
        let mut sealed_memtables = SealedMemtables::default();
        for &id in sealed {
            sealed_memtables = sealed_memtables.add(Arc::new(Memtable::new(id)));
        }
        SuperVersion {
            active_memtable: Arc::new(Memtable::new(active)),
            sealed_memtables: Arc::new(sealed_memtables),
            version: Version::new(id, crate::TreeType::Standard),
            seqno: 0,
        }
    }

    fn sealed_ids(v: &SuperVersion) -> Vec<u64> {
        v.sealed_memtables.iter().map(|mt| mt.id).collect()
    }

    /// agentstate patch: `maintenance` only takes versions out of the
    /// history; their files go at `Retired::finish`, after the caller has
    /// released the lock.
    #[test]
    fn maintenance_leaves_the_files_to_finish() -> crate::Result<()> {
        let dir = tempfile::tempdir()?;
        let mut history = SuperVersions(
            (0..3)
                .map(|i| {
                    let mut v = one_version(i, 9, &[]);
                    v.seqno = i;
                    v
                })
                .collect(),
        );
        for i in 0..3 {
            std::fs::write(dir.path().join(format!("v{i}")), b"x")?;
        }

        let retired = history.maintenance(dir.path(), 3);
        assert_eq!(0, history.free_list_len());
        assert_eq!(2, history.latest_version().version.id());
        for i in 0..3 {
            assert!(
                dir.path().join(format!("v{i}")).try_exists()?,
                "v{i} before finish"
            );
        }

        retired.finish()?;
        assert!(!dir.path().join("v0").try_exists()?);
        assert!(!dir.path().join("v1").try_exists()?);
        assert!(
            dir.path().join("v2").try_exists()?,
            "the latest version's file stays"
        );

        // A file already gone is not an error.
        let mut history =
            SuperVersions(vec![one_version(5, 9, &[]), one_version(6, 9, &[])].into());
        history.0[1].seqno = 1;
        history.maintenance(dir.path(), 2).finish()?;
        assert_eq!(0, history.free_list_len());
        Ok(())
    }

    /// agentstate patch: the next version is computed and written with no
    /// lock held, and a rotation that seals the active memtable meanwhile
    /// is kept in the published super version, less what `f` released.
    #[test]
    fn upgrade_version_unblocked_keeps_a_rotation_made_while_it_writes() -> crate::Result<()> {
        let dir = tempfile::tempdir()?;
        let history = RwLock::new(SuperVersions(vec![one_version(0, 3, &[1, 2])].into()));
        let seqno = SequenceNumberCounter::new(10);
        let visible = SequenceNumberCounter::new(10);

        let retired = SuperVersions::upgrade_version_unblocked(
            &history,
            dir.path(),
            |current| {
                // A writer's rotation, while the version is prepared: it
                // needs the write lock, so none may be held here.
                let mut w = history.try_write().expect("no lock held while f runs");
                let mut rotated = w.latest_version();
                rotated.sealed_memtables = Arc::new(
                    rotated
                        .sealed_memtables
                        .add(rotated.active_memtable.clone()),
                );
                rotated.active_memtable = Arc::new(Memtable::new(4));
                w.replace_latest_version(rotated);
                drop(w);

                // A flush of sealed memtable 1.
                let mut copy = current.clone();
                copy.version = Version::new(current.version.id() + 1, crate::TreeType::Standard);
                copy.sealed_memtables = Arc::new(copy.sealed_memtables.remove(1));
                Ok(copy)
            },
            &seqno,
            &visible,
            0,
        )?;
        retired.finish()?;
        let lock = history.read().expect("lock");

        let latest = lock.latest_version();
        assert_eq!(1, latest.version.id());
        assert_eq!(
            4, latest.active_memtable.id,
            "the rotation's active memtable"
        );
        assert_eq!(
            vec![2, 3],
            sealed_ids(&latest),
            "1 released, 3 sealed meanwhile"
        );
        assert_eq!(10, latest.seqno);
        assert_eq!(11, visible.get());
        assert_eq!(2, lock.len());
        assert!(dir.path().join("v1").try_exists()?, "the version file");
        Ok(())
    }

    /// agentstate patch: a version that changed while the next one was
    /// written (not possible while every change holds the compaction
    /// state lock) is an error, never published over.
    #[test]
    fn upgrade_version_unblocked_refuses_a_version_changed_underneath() -> crate::Result<()> {
        let dir = tempfile::tempdir()?;
        let history = RwLock::new(SuperVersions(vec![one_version(0, 3, &[])].into()));
        let seqno = SequenceNumberCounter::new(10);
        let visible = SequenceNumberCounter::new(10);

        let result = SuperVersions::upgrade_version_unblocked(
            &history,
            dir.path(),
            |current| {
                history
                    .write()
                    .expect("lock")
                    .append_version(one_version(7, 3, &[]));
                let mut copy = current.clone();
                copy.version = Version::new(current.version.id() + 1, crate::TreeType::Standard);
                Ok(copy)
            },
            &seqno,
            &visible,
            0,
        );

        assert!(matches!(result, Err(crate::Error::Unrecoverable)));
        let history = history.read().expect("lock");
        assert_eq!(
            7,
            history.latest_version().version.id(),
            "nothing published"
        );
        assert_eq!(10, visible.get());
        Ok(())
    }

    #[test]
    fn super_version_gc_above_watermark() -> crate::Result<()> {
        let mut history = SuperVersions(
            vec![
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 0,
                },
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 1,
                },
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 2,
                },
            ]
            .into(),
        );

        let dir = tempfile::tempdir()?;
        let retired = history.maintenance(dir.path(), 0);
        retired.finish()?;

        assert_eq!(history.free_list_len(), 2);

        Ok(())
    }

    #[test]
    fn super_version_gc_below_watermark_simple() -> crate::Result<()> {
        let mut history = SuperVersions(
            vec![
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 0,
                },
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 1,
                },
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 2,
                },
            ]
            .into(),
        );

        let dir = tempfile::tempdir()?;
        let retired = history.maintenance(dir.path(), 3);
        retired.finish()?;

        assert_eq!(history.len(), 1);

        Ok(())
    }

    #[test]
    fn super_version_gc_below_watermark_simple_2() -> crate::Result<()> {
        let mut history = SuperVersions(
            vec![
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 0,
                },
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 1,
                },
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 2,
                },
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 8,
                },
            ]
            .into(),
        );

        let dir = tempfile::tempdir()?;
        let retired = history.maintenance(dir.path(), 3);
        retired.finish()?;

        assert_eq!(history.len(), 2);

        Ok(())
    }

    #[test]
    fn super_version_gc_below_watermark_keep() -> crate::Result<()> {
        let mut history = SuperVersions(
            vec![
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 0,
                },
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 8,
                },
            ]
            .into(),
        );

        let dir = tempfile::tempdir()?;
        let retired = history.maintenance(dir.path(), 3);
        retired.finish()?;

        assert_eq!(history.len(), 2);

        Ok(())
    }

    #[test]
    fn super_version_gc_below_watermark_shadowed() -> crate::Result<()> {
        let mut history = SuperVersions(
            vec![
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 0,
                },
                SuperVersion {
                    active_memtable: Arc::new(Memtable::new(0)),
                    sealed_memtables: Arc::default(),
                    version: Version::new(0, crate::TreeType::Standard),
                    seqno: 2,
                },
            ]
            .into(),
        );

        let dir = tempfile::tempdir()?;
        let retired = history.maintenance(dir.path(), 3);
        retired.finish()?;

        assert_eq!(history.len(), 1);

        Ok(())
    }
}
