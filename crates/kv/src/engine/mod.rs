//! Engines: the small trait the store's logic runs on, and its two
//! implementations. Everything that touches an engine's own API stays in
//! this module.

pub(crate) mod file;
pub(crate) mod journal;
pub(crate) mod memory;
#[cfg(feature = "sled")]
pub(crate) mod sled;

use std::path::Path;

use agentstate_core::error::Result;
use agentstate_core::options::{FileEngine, Tuning};

/// One write of a batch: a value to put, or `None` to delete.
pub(crate) type Write = (Vec<u8>, Option<Vec<u8>>);

/// What [`Engine::scan_each`] hands each pair to: `Ok(false)` stops.
pub(crate) type Visit<'a> = dyn FnMut(&[u8], &[u8]) -> Result<bool> + 'a;

/// An ordered key-value engine.
///
/// Invariant: `commit` is atomic (all of a batch or none is ever visible,
/// also after a crash) and, in `Durability::Immediate`, durable before any
/// reader can see it.
pub(crate) trait Engine: Send + Sync {
    /// The value of `key`.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>>;
    /// Up to `limit` pairs with `start <= key < end`, ascending.
    fn scan(&self, start: &[u8], end: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>>;
    /// Hands the pairs with `start <= key < end` to `visit` in ascending
    /// order until it returns `false` (or an error, which ends the scan and
    /// is returned). The slices are borrowed from the engine where it can
    /// (no copy per entry); `visit` may read the engine, since no engine
    /// lock is held while it runs.
    ///
    /// `want` is how many pairs the caller expects to visit (a page's
    /// limit and one more). This default reads chunks of that many
    /// (16 to 1024) through [`Engine::scan`], each read at one moment and
    /// then visited, copied, with no lock held; a page that fits one chunk
    /// is read at one moment, as a page always was.
    fn scan_each(
        &self,
        start: &[u8],
        end: &[u8],
        want: usize,
        visit: &mut Visit<'_>,
    ) -> Result<()> {
        let chunk = want.clamp(16, 1024);
        let mut from = start.to_vec();
        loop {
            let entries = self.scan(&from, end, chunk)?;
            let exhausted = entries.len() < chunk;
            for (k, v) in &entries {
                if !visit(k, v)? {
                    return Ok(());
                }
            }
            match entries.last() {
                Some((k, _)) if !exhausted => from = agentstate_core::codec::key::successor(k),
                _ => return Ok(()),
            }
        }
    }
    /// Applies a batch atomically and durably.
    fn commit(&self, batch: Vec<Write>) -> Result<()>;
    /// Makes every committed batch durable (a no-op in memory).
    fn sync(&self) -> Result<()>;
    /// Bytes on disk (0 in memory).
    fn disk_bytes(&self) -> u64;
    /// Rewrites what is on disk without deleted and overwritten values,
    /// where the engine can (a no-op in memory and on sled).
    fn compact(&self) -> Result<()> {
        Ok(())
    }
}

/// Opens the file engine `kind` on the directory `dir`.
pub(crate) fn open_file(
    kind: FileEngine,
    dir: &Path,
    mode: file::SyncMode,
    tuning: Tuning,
) -> Result<Box<dyn Engine>> {
    match kind {
        FileEngine::Fjall => Ok(Box::new(file::FjallEngine::open(dir, mode, tuning)?)),
        #[cfg(feature = "sled")]
        FileEngine::Sled => Ok(Box::new(sled::SledEngine::open(dir, mode)?)),
        #[cfg(not(feature = "sled"))]
        FileEngine::Sled => Err(agentstate_core::error::StateError::invalid(
            "the sled engine needs agentstate built with the `sled` feature",
        )),
    }
}
