//! Byte formats every backend shares: values (format byte, postcard,
//! checksum), keys (the ordered component encoding, K6) and cursors (with
//! the secret a store's cursors are sealed under).

pub mod crc;
pub mod cursor;
pub mod key;
pub mod value;
