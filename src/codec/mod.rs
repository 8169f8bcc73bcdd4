//! Byte formats, written once for every engine: keys, values and cursors.

pub(crate) mod cursor;
pub(crate) mod key;
pub(crate) mod value;
