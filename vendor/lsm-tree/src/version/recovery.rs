// Copyright (c) 2024-present, fjall-rs
// This source code is licensed under both the Apache 2.0 and MIT License
// (found in the LICENSE-* files in the repository)

use crate::{
    coding::Decode,
    file::{SectionBytes as _, CURRENT_VERSION_FILE},
    version::VersionId,
    vlog::BlobFileId,
    Checksum, SeqNo, TableId, TreeType,
};
use byteorder::{LittleEndian, ReadBytesExt};
use std::path::Path;

pub struct RecoveredTable {
    pub id: TableId,
    pub checksum: Checksum,
    pub global_seqno: SeqNo,
}

pub struct Recovery {
    pub tree_type: TreeType,
    pub curr_version_id: VersionId,
    pub table_ids: Vec<Vec<Vec<RecoveredTable>>>,
    pub blob_file_ids: Vec<(BlobFileId, Checksum)>,
    pub gc_stats: crate::blob_tree::FragmentationMap,
    /// agentstate patch: the version file's bytes, which also hold the
    /// tree's manifest (decoded from them, not read again).
    pub bytes: Vec<u8>,
}

/// agentstate patch: the whole `current` file: the version id (u64 LE),
/// the xxh3-128 of the version file (u128 LE) and the checksum type (0,
/// xxh3), as `persist.rs` writes it. Anything else is damage.
fn read_current(folder: &Path) -> crate::Result<(VersionId, u128)> {
    use std::io::Read;

    let mut bytes = Vec::with_capacity(32);
    std::fs::File::open(folder.join(CURRENT_VERSION_FILE))?.read_to_end(&mut bytes)?;
    let id = bytes.get(..8).and_then(|b| b.try_into().ok());
    let sum = bytes.get(8..24).and_then(|b| b.try_into().ok());
    match (id, sum, bytes.get(24..)) {
        (Some(id), Some(sum), Some([0])) => Ok((u64::from_le_bytes(id), u128::from_le_bytes(sum))),
        _ => {
            log::error!(
                "{CURRENT_VERSION_FILE} in {} is not a version pointer",
                folder.display()
            );
            Err(crate::Error::Unrecoverable)
        }
    }
}

pub fn recover(folder: &Path) -> crate::Result<Recovery> {
    // agentstate patch: the version file is checked against the checksum
    // `current` records before any of it is parsed (upstream left this as
    // a TODO; a damaged count in it made the parser allocate without bound
    // and abort). A `current` naming a version file that is not there is
    // damage too, not an I/O error.
    let (curr_version_id, want) = read_current(folder)?;
    let version_file_path = folder.join(format!("v{curr_version_id}"));

    log::info!(
        "Recovering current manifest at {}",
        version_file_path.display(),
    );

    // agentstate patch: the version file read once; its sections are
    // parsed from memory (each section's reader opened the file again:
    // nine opens of it per tree at every open, with the manifest's).
    let bytes = match std::fs::read(&version_file_path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            log::error!("{} is missing", version_file_path.display());
            return Err(crate::Error::Unrecoverable);
        }
        Err(e) => return Err(e.into()),
    };
    let got = xxhash_rust::xxh3::xxh3_128(&bytes);
    if got != want {
        log::error!(
            "{} does not match its checksum",
            version_file_path.display()
        );
        return Err(crate::Error::ChecksumMismatch {
            got: Checksum::from_raw(got),
            expected: Checksum::from_raw(want),
        });
    }
    let reader = sfa::Reader::from_reader(&mut std::io::Cursor::new(&bytes))?;
    let toc = reader.toc();

    // // TODO: vvv move into Version::decode vvv
    let mut levels = vec![];

    {
        let mut reader = toc
            .section(b"tables")
            .ok_or(crate::Error::Unrecoverable)
            .inspect_err(|_| {
                log::error!("tables section not found in version #{curr_version_id} - maybe the file is corrupted?");
            })?
            .in_bytes(&bytes)?;

        let level_count = reader.read_u8()?;

        for _ in 0..level_count {
            let mut level = vec![];
            let run_count = reader.read_u8()?;

            for _ in 0..run_count {
                let mut run = vec![];
                let table_count = reader.read_u32::<LittleEndian>()?;

                for _ in 0..table_count {
                    let id = reader.read_u64::<LittleEndian>()?;
                    let checksum_type = reader.read_u8()?;

                    if checksum_type != 0 {
                        return Err(crate::Error::InvalidTag(("ChecksumType", checksum_type)));
                    }

                    let checksum = reader.read_u128::<LittleEndian>()?;
                    let checksum = Checksum::from_raw(checksum);

                    let global_seqno = reader.read_u64::<LittleEndian>()?;

                    run.push(RecoveredTable {
                        id,
                        checksum,
                        global_seqno,
                    });
                }

                level.push(run);
            }

            levels.push(level);
        }
    }

    let blob_file_ids = {
        let mut reader = toc
            .section(b"blob_files")
            .ok_or(crate::Error::Unrecoverable)
            .inspect_err(|_| {
                log::error!("blob_files section not found in version #{curr_version_id} - maybe the file is corrupted?");
            })?
            .in_bytes(&bytes)?;

        let blob_file_count = reader.read_u32::<LittleEndian>()?;
        let mut blob_file_ids = Vec::with_capacity(blob_file_count as usize);

        for _ in 0..blob_file_count {
            let id = reader.read_u64::<LittleEndian>()?;

            let checksum_type = reader.read_u8()?;

            if checksum_type != 0 {
                return Err(crate::Error::InvalidTag(("ChecksumType", checksum_type)));
            }

            let checksum = reader.read_u128::<LittleEndian>()?;
            let checksum = Checksum::from_raw(checksum);

            blob_file_ids.push((id, checksum));
        }

        blob_file_ids.sort_by_key(|(id, _)| *id);
        blob_file_ids
    };

    debug_assert!(blob_file_ids.is_sorted_by_key(|(id, _)| id));

    let gc_stats = {
        let mut reader = toc
            .section(b"blob_gc_stats")
            .ok_or(crate::Error::Unrecoverable)
            .inspect_err(|_| {
                log::error!("blob_gc_stats section not found in version #{curr_version_id} - maybe the file is corrupted?");
            })?
            .in_bytes(&bytes)?;

        crate::blob_tree::FragmentationMap::decode_from(&mut reader)?
    };

    Ok(Recovery {
        tree_type: {
            let byte = toc.section(b"tree_type").ok_or(crate::Error::Unrecoverable)
            .inspect_err(|_|{
                log::error!("tree_type section not found in version #{curr_version_id} - maybe the file is corrupted?");
            })?
            .in_bytes(&bytes)?
            .read_u8()?;

            TreeType::try_from(byte).map_err(|()| crate::Error::InvalidHeader("TreeType"))?
        },
        curr_version_id,
        table_ids: levels,
        blob_file_ids,
        gc_stats,
        bytes,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::{version::persist::persist_version, version::Version};

    /// agentstate patch: a version file is checked against `current`
    /// before it is parsed; a damaged pointer or a missing file is damage.
    #[test]
    fn recover_checks_the_version_file_against_current() -> crate::Result<()> {
        let dir = tempfile::tempdir()?;
        persist_version(dir.path(), &Version::new(0, TreeType::Standard))?;
        assert_eq!(0, recover(dir.path())?.curr_version_id);

        let v0 = dir.path().join("v0");
        let pristine = std::fs::read(&v0)?;
        for at in [0, pristine.len() / 2, pristine.len() - 1] {
            let mut bytes = pristine.clone();
            bytes[at] ^= 0x40;
            std::fs::write(&v0, &bytes)?;
            assert!(
                matches!(
                    recover(dir.path()),
                    Err(crate::Error::ChecksumMismatch { .. })
                ),
                "flip at {at}"
            );
        }
        std::fs::write(&v0, &pristine)?;

        let current = dir.path().join(CURRENT_VERSION_FILE);
        let good = std::fs::read(&current)?;
        for bad in [
            &good[..24],
            &[&good[..], &[0]].concat()[..],
            &[&good[..24], &[1]].concat()[..],
        ] {
            std::fs::write(&current, bad)?;
            assert!(matches!(
                recover(dir.path()),
                Err(crate::Error::Unrecoverable)
            ));
        }
        std::fs::write(&current, &good)?;
        std::fs::remove_file(&v0)?;
        assert!(matches!(
            recover(dir.path()),
            Err(crate::Error::Unrecoverable)
        ));
        Ok(())
    }
}
