//! agentstate's embedded backends: [`MemoryStore`] and [`FileStore`].
//!
//! Both are handles (`handles.rs`) on one key-value store: the rules as
//! jobs on one group-commit path, over a small ordered-engine trait
//! (`engine/`: memory, fjall, sled), with its key layout (`key.rs`).
//! Users depend on the `agentstate` facade, which re-exports both.

// No unsafe code in this crate (the engines under vendor/ are fjall's).
#![forbid(unsafe_code)]
// Every public item is documented; the docs are part of the contract.
#![warn(missing_docs)]
// docs.rs (`--cfg docsrs`) marks each item with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
// Operating errors are handled, never unwrapped, outside tests: each
// remaining `expect` states the invariant that makes it unreachable.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

mod budgets;
mod commit;
pub(crate) mod engine;
mod feed;
mod file;
#[doc(hidden)]
pub mod key;
#[cfg(all(test, loom))]
mod loom_models;
mod runs;
mod sessions;
mod sessions_list;
pub(crate) mod sync;
mod transfer;
mod trays;
mod upgrade;
mod verify;

use std::path::Path;

mod handles;
mod idempotency;

pub use handles::{FileStore, MemoryStore};

use crate::engine::{Engine, Write};
use crate::key::meta;
use crate::sync::{AtomicBool, Ordering};
use agentstate_core::codec::value;
use agentstate_core::error::{Result, StateError};
pub(crate) use agentstate_core::options::{Durability, Options};
use commit::{Committer, Counters, Sink, Txn};

/// The key-value store's logic over one engine; [`MemoryStore`] and
/// [`FileStore`] are the two public handles that hold one.
pub(crate) struct KvStore {
    engine: Box<dyn Engine>,
    committer: Committer,
    opts: Options,
    secret: [u8; 16],
    /// Set when a commit failed; writes are refused until reopened (D6).
    poisoned: AtomicBool,
    file: Option<file::FileState>,
    /// Where a due-alarm listing may start (see `trays::AlarmFloor`).
    alarm_floor: trays::AlarmFloor,
    /// Where `get_run` last found runs (see `runs::SeqHints`).
    seq_hints: runs::SeqHints,
    /// Wakes `wait_changes` after each commit.
    feed_wake: feed::Wake,
}

impl std::fmt::Debug for KvStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStore")
            .field("path", &self.path())
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl KvStore {
    /// The directory of a file store; `None` in memory.
    pub(crate) fn path(&self) -> Option<&Path> {
        self.file.as_ref().map(|f| f.path())
    }

    /// Builds a store over an engine, writing the meta values of a new one.
    pub(crate) fn assemble(
        engine: Box<dyn Engine>,
        opts: Options,
        file: Option<file::FileState>,
    ) -> Result<KvStore> {
        let format: Option<u8> = match engine.get(meta::FORMAT)? {
            Some(v) => Some(value::decode(&v, "format version")?),
            None => None,
        };
        let (secret, counters) = match format {
            Some(_) => {
                let secret: [u8; 16] = read_meta(&*engine, meta::SECRET)?;
                let next_seq: u64 = read_meta(&*engine, meta::NEXT_SEQ)?;
                let commits: u64 = read_meta(&*engine, meta::COMMITS)?;
                // A store from before the feed starts it at 1 (its open
                // then fills it: `fill_feed`).
                let next_feed: u64 = match engine.get(meta::NEXT_FEED)? {
                    Some(v) => value::decode(&v, "next feed position")?,
                    None => 1,
                };
                (
                    secret,
                    Counters {
                        next_seq,
                        commits,
                        next_feed,
                    },
                )
            }
            None => {
                let secret = agentstate_core::codec::cursor::new_secret();
                let counters = Counters {
                    next_seq: 1,
                    commits: 0,
                    next_feed: 1,
                };
                engine.commit(vec![
                    (
                        meta::FORMAT.to_vec(),
                        Some(value::encode(&upgrade::STORE_FORMAT)),
                    ),
                    (meta::SECRET.to_vec(), Some(value::encode(&secret))),
                    (
                        meta::NEXT_SEQ.to_vec(),
                        Some(value::encode(&counters.next_seq)),
                    ),
                    (
                        meta::COMMITS.to_vec(),
                        Some(value::encode(&counters.commits)),
                    ),
                    (
                        meta::NEXT_FEED.to_vec(),
                        Some(value::encode(&counters.next_feed)),
                    ),
                    (meta::FEED_FILLED.to_vec(), Some(value::encode(&true))),
                ])?;
                (secret, counters)
            }
        };
        Ok(KvStore {
            engine,
            committer: Committer::new(counters),
            opts,
            secret,
            poisoned: AtomicBool::new(false),
            file,
            alarm_floor: trays::AlarmFloor::default(),
            seq_hints: runs::SeqHints::default(),
            feed_wake: feed::Wake::default(),
        })
    }

    /// Runs `f` through the commit path (see `store::commit`).
    fn submit<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Txn<'_>) -> Result<T> + Send + 'static,
    {
        self.committer.submit(self, f)
    }

    fn now(&self) -> u64 {
        self.opts.clock.now_millis()
    }

    /// Groups committed since the store was created.
    pub(crate) fn commits(&self) -> u64 {
        self.committer.counters().commits
    }

    /// See [`FileStore::compact`].
    pub(crate) fn compact(&self) -> Result<()> {
        self.engine.compact()
    }
}

impl Sink for KvStore {
    fn commit(&self, mut batch: Vec<Write>, counters: Counters) -> Result<()> {
        // The counters are read back only by a reopen: a memory store keeps
        // them in the committer alone (its META values stay those of its
        // creation).
        if self.file.is_some() {
            batch.push((
                meta::NEXT_SEQ.to_vec(),
                Some(value::encode(&counters.next_seq)),
            ));
            batch.push((
                meta::COMMITS.to_vec(),
                Some(value::encode(&counters.commits)),
            ));
            batch.push((
                meta::NEXT_FEED.to_vec(),
                Some(value::encode(&counters.next_feed)),
            ));
        }
        match self.engine.commit(batch) {
            Ok(()) => {
                if let (Some(f), Durability::Immediate) = (&self.file, self.opts.durability) {
                    f.committed(counters.commits);
                }
                self.feed_wake.committed();
                Ok(())
            }
            Err(e) => {
                // D6: never acknowledge again until reopened.
                self.poisoned.store(true, Ordering::SeqCst);
                // The batch went to the engine's journal: whether it is
                // there after a reopen is unknown (rule I7). The writes
                // refused from now on certainly did not apply.
                Err(match e {
                    StateError::Persistence {
                        reason: agentstate_core::error::PersistenceReason::Unavailable,
                        detail,
                        source,
                    } => StateError::outcome_unknown(
                        format!(
                            "{detail} (the write may be in the journal: it is there after a reopen or it is not)"
                        ),
                        source,
                    ),
                    e => e,
                })
            }
        }
    }

    fn refused(&self) -> Option<StateError> {
        self.poisoned.load(Ordering::SeqCst).then(|| {
            StateError::unavailable(
                "an earlier write failed to persist; the store refuses writes until reopened",
                None,
            )
        })
    }

    fn engine(&self) -> &dyn Engine {
        &*self.engine
    }

    fn seq_hints(&self) -> Option<&runs::SeqHints> {
        Some(&self.seq_hints)
    }
}

impl Drop for KvStore {
    fn drop(&mut self) {
        if let Some(f) = &self.file {
            // The mark may only count commits that are on disk: in
            // `Buffered` mode, sync them first.
            let synced =
                self.opts.durability == Durability::Immediate || self.engine.sync().is_ok();
            f.close(
                self.committer.counters().commits,
                synced && !self.poisoned.load(Ordering::SeqCst),
            );
        }
    }
}

fn read_meta<T: serde::de::DeserializeOwned>(engine: &dyn Engine, key: &[u8]) -> Result<T> {
    let v = engine
        .get(key)?
        .ok_or_else(|| StateError::corrupt(format!("meta value {:?} missing", key[1] as char)))?;
    value::decode(&v, "meta value")
}

pub(crate) use agentstate_core::rules::{check_id, check_limit, check_size};

const _: () = {
    const fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<KvStore>();
};

use agentstate_core::codec::cursor::{self as cursor_codec, Listing};
use agentstate_core::codec::key::successor;
use agentstate_core::page::{Page, PageRequest};

impl KvStore {
    /// One page of a listing over the keys in `lo..hi`, read straight from
    /// the engine: `accept` turns an entry into an item or skips it. Reads
    /// one matching entry past the page to know whether the walk ends here
    /// (L3), and costs O(limit + skipped entries) (L5).
    pub(crate) fn scan_page<T>(
        &self,
        listing: Listing,
        binding: &[u8],
        lo: &[u8],
        hi: &[u8],
        page: &PageRequest,
        mut accept: impl FnMut(&[u8], &[u8]) -> Result<Option<T>>,
    ) -> Result<Page<T>> {
        let limit = page.limit;
        check_limit(limit)?;
        let start = match self.cursor_position(listing, binding, lo, hi, page)? {
            None => lo.to_vec(),
            Some(pos) => successor(&pos),
        };
        // One scan that stops at the first match past the page (which says
        // a next page exists); of the keys only the page's last is kept,
        // for its cursor, and the entries are read in place.
        let mut items: Vec<T> = Vec::with_capacity(limit);
        let mut last = Vec::new();
        let mut more = false;
        self.engine.scan_each(&start, hi, limit + 1, &mut |k, v| {
            let Some(item) = accept(k, v)? else {
                return Ok(true);
            };
            if items.len() == limit {
                more = true;
                return Ok(false);
            }
            items.push(item);
            if items.len() == limit {
                last.extend_from_slice(k);
            }
            Ok(true)
        })?;
        let cursor = more.then(|| self.cursor_at(listing, binding, &last));
        Page::new(items, cursor)
    }

    /// The position a page's cursor holds, checked to lie inside the
    /// listing's range `lo..hi`; `None` for a first page.
    pub(crate) fn cursor_position(
        &self,
        listing: Listing,
        binding: &[u8],
        lo: &[u8],
        hi: &[u8],
        page: &PageRequest,
    ) -> Result<Option<Vec<u8>>> {
        let Some(c) = &page.cursor else {
            return Ok(None);
        };
        let pos = cursor_codec::decode(&self.secret, listing, binding, c)?;
        // A position is inside the listing's range. The export spans
        // several tables, so its positions need not share `lo`'s table
        // byte; a due-alarm listing asked again with an earlier `now` may
        // hold a position past `hi` in its table.
        if pos.as_slice() < lo || (pos.as_slice() >= hi && !pos.starts_with(&lo[..1])) {
            return Err(StateError::invalid("cursor: position outside this listing"));
        }
        Ok(Some(pos))
    }

    /// The cursor of a page whose last item is at `position`.
    pub(crate) fn cursor_at(
        &self,
        listing: Listing,
        binding: &[u8],
        position: &[u8],
    ) -> agentstate_core::cursor::Cursor {
        cursor_codec::encode(&self.secret, listing, binding, position)
    }
}
