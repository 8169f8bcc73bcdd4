//! Thin entry points into the private codecs, for the fuzz targets in
//! `fuzz/` and the tests that replay their findings. Not part of the API:
//! it may change in any release.

use agentstate_core::codec::cursor::{self, Listing};
use agentstate_core::codec::key::{KeyBuf, KeyReader};
use agentstate_core::codec::value;
use agentstate_core::cursor::Cursor;
use agentstate_core::error::Result;
use agentstate_core::record::{RunRecord, SessionRecord};
use agentstate_core::tray::Tray;
use agentstate_kv::key::table;

/// Decodes a stored run value (format byte, postcard body, checksum).
pub fn decode_run(bytes: &[u8]) -> Result<RunRecord> {
    value::decode_run(bytes)
}

/// Encodes a run as the store writes it.
pub fn encode_run(run: &RunRecord) -> Vec<u8> {
    value::encode_run(run)
}

/// Decodes a stored session value.
pub fn decode_session(bytes: &[u8]) -> Result<SessionRecord> {
    value::decode_session(bytes)
}

/// Encodes a session as the store writes it.
pub fn encode_session(session: &SessionRecord) -> Vec<u8> {
    value::encode_session(session)
}

/// Decodes a stored tray value.
pub fn decode_tray(bytes: &[u8]) -> Result<Tray> {
    value::decode(bytes, "tray")
}

/// Encodes a tray as the store writes it.
pub fn encode_tray(tray: &Tray) -> Vec<u8> {
    value::encode(tray)
}

/// The key of string components (in the run table), as the store builds
/// its keys.
pub fn encode_key(components: &[&str]) -> Vec<u8> {
    components
        .iter()
        .fold(KeyBuf::table(table::RUN), |b, c| b.str(c))
        .done()
}

/// Reads a key of the run table back into exactly `n` string components.
pub fn decode_key(key: &[u8], n: usize) -> Result<Vec<String>> {
    let mut r = KeyReader::new(key, table::RUN)?;
    let parts = (0..n).map(|_| r.str()).collect::<Result<Vec<_>>>()?;
    r.end()?;
    Ok(parts)
}

/// Reads string components until `key` ends or one fails to decode; the
/// components read, and whether the whole key decoded without error.
pub fn decode_key_greedy(key: &[u8]) -> (Vec<String>, bool) {
    let Ok(mut r) = KeyReader::new(key, table::RUN) else {
        return (Vec::new(), false);
    };
    let mut parts = Vec::new();
    loop {
        match r.str() {
            Ok(s) => parts.push(s),
            // The reader is not to be used after an error (it may have
            // stepped past the bad component): the key did not decode.
            Err(_) => return (parts, false),
        }
        if r.at_end() {
            return (parts, true);
        }
    }
}

/// The secret the cursor helpers below sign with.
pub const CURSOR_SECRET: [u8; 16] = *b"fuzz-cursor-key!";

/// A runs-listing cursor for `binding` that ends at `position`, an engine
/// key (never empty).
pub fn encode_cursor(binding: &[u8], position: &[u8]) -> Cursor {
    cursor::encode(&CURSOR_SECRET, Listing::Runs, binding, position)
}

/// Checks a runs-listing cursor against `binding`; its position when valid.
pub fn decode_cursor(binding: &[u8], cursor: &Cursor) -> Result<Vec<u8>> {
    cursor::decode(&CURSOR_SECRET, Listing::Runs, binding, cursor)
}
