//! Byte formats every backend shares: values (format byte, postcard,
//! checksum), keys (the ordered component encoding, K6) and cursors (with
//! the secret a store's cursors are sealed under).

pub(crate) mod crc;
pub(crate) mod cursor;
pub(crate) mod key;
pub(crate) mod value;
