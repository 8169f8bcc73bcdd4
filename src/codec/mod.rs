//! Byte formats every backend shares: values (format byte, postcard,
//! checksum) and cursors. The key-value store's key codec is `kv::key`.

pub(crate) mod crc;
pub(crate) mod cursor;
pub(crate) mod value;
