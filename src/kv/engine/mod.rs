//! Engines: the small trait the store's logic runs on, and its two
//! implementations. Everything that touches an engine's own API stays in
//! this module.

pub(crate) mod file;
pub(crate) mod journal;
pub(crate) mod memory;
#[cfg(feature = "sled")]
pub(crate) mod sled;

use std::path::Path;

use crate::error::Result;
use crate::options::FileEngine;

/// One write of a batch: a value to put, or `None` to delete.
pub(crate) type Write = (Vec<u8>, Option<Vec<u8>>);

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
    /// Applies a batch atomically and durably.
    fn commit(&self, batch: Vec<Write>) -> Result<()>;
    /// Makes every committed batch durable (a no-op in memory).
    fn sync(&self) -> Result<()>;
    /// Bytes on disk (0 in memory).
    fn disk_bytes(&self) -> u64;
}

/// Opens the file engine `kind` on the directory `dir`.
pub(crate) fn open_file(
    kind: FileEngine,
    dir: &Path,
    mode: file::SyncMode,
    tuning: file::Tuning,
) -> Result<Box<dyn Engine>> {
    match kind {
        FileEngine::Fjall => Ok(Box::new(file::FjallEngine::open(dir, mode, tuning)?)),
        #[cfg(feature = "sled")]
        FileEngine::Sled => Ok(Box::new(sled::SledEngine::open(dir, mode)?)),
        #[cfg(not(feature = "sled"))]
        FileEngine::Sled => Err(crate::error::StateError::invalid(
            "the sled engine needs agentstate built with the `sled` feature",
        )),
    }
}
