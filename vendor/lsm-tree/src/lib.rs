// Copyright (c) 2024-present, fjall-rs
// This source code is licensed under both the Apache 2.0 and MIT License
// (found in the LICENSE-* files in the repository)

//! A K.I.S.S. implementation of log-structured merge trees (LSM-trees/LSMTs).
//!
//! ##### NOTE
//!
//! > This crate only provides a primitive LSM-tree, not a full storage engine.
//! > You probably want to use <https://crates.io/crates/fjall> instead.
//! > For example, it does not ship with a write-ahead log, so writes are not
//! > persisted until manually flushing the memtable.
//!
//! ##### About
//!
//! This crate exports a `Tree` that supports a subset of the `BTreeMap` API.
//!
//! LSM-trees are an alternative to B-trees to persist a sorted list of items (e.g. a database table)
//! on disk and perform fast lookup queries.
//! Instead of updating a disk-based data structure in-place,
//! deltas (inserts and deletes) are added into an in-memory write buffer (`Memtable`).
//! Data is then flushed to disk-resident table files when the write buffer reaches some threshold.
//!
//! Amassing many tables on disk will degrade read performance and waste disk space, so tables
//! can be periodically merged into larger tables in a process called `Compaction`.
//! Different compaction strategies have different advantages and drawbacks, and should be chosen based
//! on the workload characteristics.
//!
//! Because maintaining an efficient structure is deferred to the compaction process, writing to an LSMT
//! is very fast (_O(1)_ complexity).
//!
//! Keys are limited to 65536 bytes, values are limited to 2^32 bytes. As is normal with any kind of storage
//! engine, larger keys and values have a bigger performance impact.

#![doc(html_logo_url = "https://raw.githubusercontent.com/fjall-rs/lsm-tree/main/logo.png")]
#![doc(html_favicon_url = "https://raw.githubusercontent.com/fjall-rs/lsm-tree/main/logo.png")]
#![deny(clippy::all, missing_docs, clippy::cargo)]
#![deny(clippy::unwrap_used)]
#![deny(clippy::indexing_slicing)]
#![warn(clippy::pedantic, clippy::nursery)]
#![warn(clippy::expect_used)]
#![allow(clippy::missing_const_for_fn)]
#![warn(clippy::multiple_crate_versions)]
#![allow(clippy::option_if_let_else)]
#![warn(clippy::redundant_feature_names)]
#![cfg_attr(coverage_nightly, feature(coverage_attribute))]

#[doc(hidden)]
pub type HashMap<K, V> = std::collections::HashMap<K, V, rustc_hash::FxBuildHasher>;

pub(crate) type HashSet<K> = std::collections::HashSet<K, rustc_hash::FxBuildHasher>;

macro_rules! fail_iter {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return Some(Err(e.into())),
        }
    };
}

macro_rules! unwrap {
    ($x:expr) => {{
        $x.expect("should read")
    }};
}

mod any_tree;

mod abstract_tree;

#[doc(hidden)]
pub mod blob_tree;

#[doc(hidden)]
mod cache;

#[doc(hidden)]
pub mod checksum;

#[doc(hidden)]
pub mod coding;

pub mod compaction;
mod compression;

/// Configuration
pub mod config;

#[doc(hidden)]
pub mod descriptor_table;

#[doc(hidden)]
pub mod file_accessor;

mod double_ended_peekable;
mod error;

#[doc(hidden)]
pub mod file;

mod hash;
mod ingestion;
mod iter_guard;
mod key;
mod key_range;
mod manifest;
mod memtable;
mod run_reader;
mod run_scanner;

#[doc(hidden)]
pub mod merge;

#[cfg(feature = "metrics")]
pub(crate) mod metrics;

// mod multi_reader;

#[doc(hidden)]
pub mod mvcc_stream;

mod path;

#[doc(hidden)]
pub mod range;

#[doc(hidden)]
pub mod table;

mod seqno;
mod slice;
mod slice_windows;

#[doc(hidden)]
pub mod stop_signal;

mod format_version;
mod time;
mod tree;

/// Utility functions
pub mod util;

mod value;
mod value_type;
mod version;
mod vlog;

/// User defined key (byte array)
pub type UserKey = Slice;

/// User defined data (byte array)
pub type UserValue = Slice;

/// KV-tuple (key + value)
pub type KvPair = (UserKey, UserValue);

#[doc(hidden)]
pub use {
    blob_tree::{handle::BlobIndirection, Guard as BlobGuard},
    checksum::Checksum,
    iter_guard::IterGuardImpl,
    key_range::KeyRange,
    merge::BoxedIterator,
    slice::Builder,
    table::{GlobalTableId, Table, TableId},
    tree::inner::TreeId,
    tree::Guard as StandardGuard,
    value::InternalValue,
};

pub use {
    abstract_tree::AbstractTree,
    any_tree::AnyTree,
    blob_tree::BlobTree,
    cache::Cache,
    compression::CompressionType,
    config::{Config, KvSeparationOptions, TreeType},
    descriptor_table::DescriptorTable,
    error::{Error, Result},
    format_version::FormatVersion,
    ingestion::AnyIngestion,
    iter_guard::IterGuard as Guard,
    memtable::{Memtable, MemtableId},
    seqno::SequenceNumberCounter,
    slice::Slice,
    tree::{delete_discarded_tables, Tree},
    value::SeqNo,
    value_type::ValueType,
    vlog::BlobFile,
};

#[cfg(feature = "metrics")]
pub use metrics::Metrics;

/// agentstate patch: names the patch queue this lsm-tree was built from
/// (`patches/lsm-tree/` in the agentstate repository). Upstream has no such
/// item, so code that refers to it does not build against an unpatched
/// lsm-tree; fjall checks it at compile time.
#[doc(hidden)]
pub const AGENTSTATE_PATCH_QUEUE: &str = "agentstate patch queue 1: fjall 3.1.13, lsm-tree 3.1.10";

/// agentstate patch: the machine's parallelism, asked once per process.
///
/// `std::thread::available_parallelism` reads `/proc/self/cgroup` and the
/// cgroup's CPU quota files, 40–55 µs a call on a small VM, and an open
/// asked it three times: once for fjall's workers and once for each
/// concurrent map's shard count (quick_cache's, then dashmap's, each with
/// its own memo). Those maps now take their shard count from here, and so
/// does fjall.
///
/// On Linux the answer is the CPUs this process may run on
/// (`sched_getaffinity`, one system call), not std's figure, which also
/// walks the cgroup's quota files (~20 system calls, 85–100 µs of a
/// 1 ms open on a 2-core VM). Both only size things here: fjall's worker
/// count (at most 4 whatever the answer) and the concurrent maps' shard
/// counts (`default_shards`, capped), so a CPU quota below the CPUs the
/// process may use changes no behaviour, only how many idle workers wait.
#[must_use]
pub fn available_cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| {
        affinity_cores()
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
    })
}

/// The CPUs in this process's affinity mask; `None` where that cannot be
/// asked (another OS, or a mask wider than `cpu_set_t`'s 1024 CPUs).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn affinity_cores() -> Option<usize> {
    // SAFETY: `cpu_set_t` is a plain bit array, for which all zeros is the
    // empty set; the kernel writes at most the size passed, which is the
    // set's own; `CPU_COUNT` only reads the set.
    let count = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        libc::CPU_COUNT(&set)
    };
    usize::try_from(count).ok().filter(|&n| n > 0)
}

#[cfg(not(target_os = "linux"))]
fn affinity_cores() -> Option<usize> {
    None
}

/// The shard count a concurrent map gets: quick_cache's and dashmap's own
/// default (four per core, a power of two).
#[must_use]
pub fn default_shards() -> usize {
    // agentstate patch: at most 64, so a process allowed on many CPUs (a
    // container under a CPU quota on a large host) does not split a small
    // cache into shards too small to hold a few blocks each.
    (available_cores() * 4).next_power_of_two().min(64)
}

#[doc(hidden)]
#[must_use]
#[allow(missing_docs, clippy::missing_errors_doc, clippy::unwrap_used)]
pub fn get_tmp_folder() -> tempfile::TempDir {
    if let Ok(p) = std::env::var("LSMT_TMP_FOLDER") {
        tempfile::tempdir_in(p)
    } else {
        tempfile::tempdir()
    }
    .unwrap()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod parallelism_tests {
    /// agentstate patch: the affinity mask's count is never below std's
    /// answer (std takes the smaller of it and the cgroup's quota), and the
    /// shard count is a power of two, at most 64.
    #[test]
    fn available_cores_counts_the_affinity_mask() {
        let std_cores = std::thread::available_parallelism().unwrap().get();
        #[cfg(target_os = "linux")]
        assert!(super::affinity_cores().unwrap() >= std_cores);
        assert!(super::available_cores() >= std_cores);
        let shards = super::default_shards();
        assert!(shards.is_power_of_two() && shards <= 64 && shards >= 4);
    }
}
