// Copyright (c) 2024-present, fjall-rs
// This source code is licensed under both the Apache 2.0 and MIT License
// (found in the LICENSE-* files in the repository)

use super::{block::ParsedItem as _, Block, DataBlock};
use crate::{
    checksum::ChecksumType, coding::Decode, table::block::BlockType, CompressionType, KeyRange,
    SeqNo, TableId,
};
use byteorder::{LittleEndian, ReadBytesExt};
use std::ops::Deref;

/// agentstate patch: a metadata block's properties, decoded in one pass.
/// `ParsedMeta` asks for about 25 of them, and each `DataBlock::point_read`
/// decoded the block from a restart point again (39k instructions a
/// table's metadata, 24.6k now); the same question is now a binary search
/// over the decoded items (sorted by key, as the block is; the first item
/// of a key is its newest, as `point_read` at `SeqNo::MAX` returns).
/// `point_read` keeps the block's signature so `load_from_block`'s reads
/// and macros are unchanged.
///
/// Only the items' keys are copied out (into one buffer); an item becomes
/// an owned value when it is read. Materializing all ~30 items up front
/// (a key allocation each, value slices, the vector, and dropping them
/// all) was 25k instructions of a table's open. The keys are copied so
/// that a search compares plain slices: comparing through each parsed
/// item's `compare_key` (prefix and rest, every step) measured 19k
/// instructions more an open of a 1M-run store.
struct Properties<'a> {
    data: &'a crate::Slice,
    /// Every item's key, one after another.
    keys: Vec<u8>,
    /// Each item in block order, with its key's range in `keys`.
    items: Vec<(usize, usize, crate::table::data_block::DataBlockParsedItem)>,
}

impl<'a> Properties<'a> {
    fn of(block: &'a DataBlock) -> Self {
        let data = &block.inner.data;
        let mut keys = Vec::with_capacity(1024);
        let mut items = Vec::with_capacity(32);
        for item in block.iter() {
            let start = keys.len();
            if let Some(prefix) = &item.prefix {
                keys.extend_from_slice(data.get(prefix.0..prefix.1).unwrap_or_default());
            }
            keys.extend_from_slice(data.get(item.key.0..item.key.1).unwrap_or_default());
            items.push((start, keys.len(), item));
        }
        Self { data, keys, items }
    }

    fn key(&self, start: usize, end: usize) -> &[u8] {
        self.keys.get(start..end).unwrap_or_default()
    }

    fn point_read(&self, key: &[u8], _seqno: SeqNo) -> Option<crate::InternalValue> {
        let at = self
            .items
            .partition_point(|(start, end, _)| self.key(*start, *end) < key);
        self.items
            .get(at)
            .filter(|(start, end, _)| self.key(*start, *end) == key)
            .map(|(_, _, item)| item.materialize(self.data))
    }
}

/// Nanosecond timestamp.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Ord, PartialOrd)]
pub struct Timestamp(u128);

impl Deref for Timestamp {
    type Target = u128;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl From<Timestamp> for u128 {
    fn from(val: Timestamp) -> Self {
        val.0
    }
}

impl From<u128> for Timestamp {
    fn from(value: u128) -> Self {
        Self(value)
    }
}

#[derive(Debug)]
pub struct ParsedMeta {
    pub id: TableId,
    pub created_at: Timestamp,
    pub data_block_count: u64,
    pub index_block_count: u64,
    pub key_range: KeyRange,
    pub(super) seqnos: (SeqNo, SeqNo),
    pub file_size: u64,
    pub item_count: u64,
    pub tombstone_count: u64,
    pub weak_tombstone_count: u64,
    pub weak_tombstone_reclaimable: u64,

    pub data_block_compression: CompressionType,
    pub index_block_compression: CompressionType,
}

macro_rules! read_u8 {
    ($block:expr, $name:expr) => {{
        let bytes = $block
            .point_read($name, SeqNo::MAX)
            .unwrap_or_else(|| panic!("meta property {:?} should exist", $name));

        let mut bytes = &bytes.value[..];
        bytes.read_u8()?
    }};
}

macro_rules! read_u64 {
    ($block:expr, $name:expr) => {{
        let bytes = $block
            .point_read($name, SeqNo::MAX)
            .unwrap_or_else(|| panic!("meta property {:?} should exist", $name));

        let mut bytes = &bytes.value[..];
        bytes.read_u64::<LittleEndian>()?
    }};
}

impl ParsedMeta {
    #[expect(clippy::expect_used, clippy::too_many_lines)]
    /// agentstate patch: the metadata from its block, already read (was
    /// `load_with_handle`, which read it; a table's open now reads it
    /// from the file's tail).
    pub fn load_from_block(block: Block) -> crate::Result<Self> {
        if block.header.block_type != BlockType::Meta {
            return Err(crate::Error::InvalidTag((
                "BlockType",
                block.header.block_type.into(),
            )));
        }

        let data_block = DataBlock::new(block);
        let block = Properties::of(&data_block);

        #[expect(clippy::indexing_slicing)]
        {
            let table_version = block
                .point_read(b"table_version", SeqNo::MAX)
                .expect("Table version should exist")
                .value;

            assert_eq!(
                [3u8],
                &*table_version,
                "unspported table version {}",
                table_version[0],
            );
        }

        {
            let hash_type = block
                .point_read(b"filter_hash_type", SeqNo::MAX)
                .expect("Filter hash type should exist")
                .value;

            assert_eq!(
                &[u8::from(ChecksumType::Xxh3)],
                &*hash_type,
                "invalid hash type: {:?}",
                std::str::from_utf8(&hash_type),
            );
        }

        {
            let hash_type = block
                .point_read(b"checksum_type", SeqNo::MAX)
                .expect("Checksum type should exist")
                .value;

            assert_eq!(
                &[u8::from(ChecksumType::Xxh3)],
                &*hash_type,
                "invalid checksum type: {:?}",
                std::str::from_utf8(&hash_type),
            );
        }

        assert_eq!(
            read_u8!(block, b"restart_interval#index"),
            1,
            "index block restart intervals >1 are not supported for this version",
        );

        let id = read_u64!(block, b"table_id");
        let item_count = read_u64!(block, b"item_count");
        let tombstone_count = read_u64!(block, b"tombstone_count");
        let data_block_count = read_u64!(block, b"block_count#data");
        let index_block_count = read_u64!(block, b"block_count#index");
        let _filter_block_count = read_u64!(block, b"block_count#filter");
        let file_size = read_u64!(block, b"file_size");
        let weak_tombstone_count = read_u64!(block, b"weak_tombstone_count");
        let weak_tombstone_reclaimable = read_u64!(block, b"weak_tombstone_reclaimable");

        let created_at = {
            let bytes = block
                .point_read(b"created_at", SeqNo::MAX)
                .expect("created_at timestamp should exist");

            let mut bytes = &bytes.value[..];
            bytes.read_u128::<LittleEndian>()?.into()
        };

        let key_range = KeyRange::new((
            block
                .point_read(b"key#min", SeqNo::MAX)
                .expect("key min should exist")
                .value,
            block
                .point_read(b"key#max", SeqNo::MAX)
                .expect("key max should exist")
                .value,
        ));

        let seqnos = {
            let min = {
                let bytes = block
                    .point_read(b"seqno#min", SeqNo::MAX)
                    .expect("seqno min should exist")
                    .value;
                let mut bytes = &bytes[..];
                bytes.read_u64::<LittleEndian>()?
            };

            let max = {
                let bytes = block
                    .point_read(b"seqno#max", SeqNo::MAX)
                    .expect("seqno max should exist")
                    .value;
                let mut bytes = &bytes[..];
                bytes.read_u64::<LittleEndian>()?
            };

            (min, max)
        };

        let data_block_compression = {
            let bytes = block
                .point_read(b"compression#data", SeqNo::MAX)
                .expect("size should exist");

            let mut bytes = &bytes.value[..];
            CompressionType::decode_from(&mut bytes)?
        };

        let index_block_compression = {
            let bytes = block
                .point_read(b"compression#index", SeqNo::MAX)
                .expect("size should exist");

            let mut bytes = &bytes.value[..];
            CompressionType::decode_from(&mut bytes)?
        };

        Ok(Self {
            id,
            created_at,
            data_block_count,
            index_block_count,
            key_range,
            seqnos,
            file_size,
            item_count,
            tombstone_count,
            weak_tombstone_count,
            weak_tombstone_reclaimable,
            data_block_compression,
            index_block_compression,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::block::Header;
    use crate::{Checksum, InternalValue, ValueType::Value};

    /// agentstate patch: `Properties` answers as `DataBlock::point_read`
    /// at `SeqNo::MAX` does, for keys that are there and keys that are not,
    /// at every restart interval, with and without a hash index.
    #[test]
    fn properties_answer_as_the_block_does() -> crate::Result<()> {
        let keys: [&[u8]; 8] = [
            b"block_count#data",
            b"checksum_type",
            b"created_at",
            b"file_size",
            b"key#max",
            b"key#min",
            b"seqno#max",
            b"table_version",
        ];
        let items: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| InternalValue::from_components(*k, vec![i as u8; i + 1], 0, Value))
            .collect();
        let probes: [&[u8]; 12] = [
            b"",
            b"a",
            b"block_count",
            b"block_count#data",
            b"block_count#datb",
            b"created_at",
            b"file_size",
            b"key#max",
            b"key#min",
            b"seqno#max",
            b"table_version",
            b"zzz",
        ];
        for restart_interval in [1, 2, 4, 16] {
            for hash_ratio in [0.0, 1.33] {
                let bytes = DataBlock::encode_into_vec(&items, restart_interval, hash_ratio)?;
                let block = DataBlock::new(Block {
                    data: bytes.into(),
                    header: Header {
                        block_type: BlockType::Meta,
                        checksum: Checksum::from_raw(0),
                        data_length: 0,
                        uncompressed_length: 0,
                    },
                });
                let properties = Properties::of(&block);
                for probe in probes {
                    assert_eq!(
                        properties.point_read(probe, SeqNo::MAX),
                        block.point_read(probe, SeqNo::MAX),
                        "{probe:?} at restart interval {restart_interval}, hash ratio {hash_ratio}",
                    );
                }
            }
        }
        Ok(())
    }
}
