//! The value codec (rules D4, D9): a format-version byte, the postcard
//! encoding, then a CRC-32 of both.

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::budget::Caps;
use crate::error::{Result, StateError};
use crate::record::{Approval, Millis, RunKey, RunRecord, RunState, ToolCall, Usage};

/// The format this build writes. A value with a higher version was written
/// by a newer release and is refused.
pub(crate) const FORMAT_VERSION: u8 = 1;
/// Version byte plus checksum.
pub(crate) const OVERHEAD_BYTES: usize = 1 + 4;

/// Encodes `v` behind the version byte, with a trailing checksum.
pub(crate) fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // postcard's std serializer only fails on types serde cannot express,
    // and every stored type is plain data.
    let mut out =
        postcard::to_extend(v, vec![FORMAT_VERSION]).expect("stored types always serialize");
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// The format of run records that carry caps or a budget (rule B1). A run
/// without either is written at [`FORMAT_VERSION`], byte for byte as
/// earlier releases wrote it, so a store that never uses caps stays
/// readable by them; a release that predates caps refuses a capped run
/// with `UnsupportedFormat` instead of misreading it.
pub(crate) const RUN_FORMAT_CAPS: u8 = 2;

/// Checks the checksum and the version byte; returns the version and the
/// postcard body.
fn checked<'a>(bytes: &'a [u8], what: &str, newest: u8) -> Result<(u8, &'a [u8])> {
    if bytes.len() < OVERHEAD_BYTES {
        return Err(StateError::corrupt(format!("{what}: value truncated")));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    let crc = u32::from_le_bytes(crc.try_into().expect("split gives 4 bytes"));
    if crc32fast::hash(body) != crc {
        return Err(StateError::corrupt(format!("{what}: checksum mismatch")));
    }
    let version = body[0];
    if version > newest {
        return Err(StateError::UnsupportedFormat {
            found: version,
            supported: newest,
        });
    }
    if version == 0 {
        return Err(StateError::corrupt(format!("{what}: format version 0")));
    }
    Ok((version, &body[1..]))
}

fn body<T: DeserializeOwned>(body: &[u8], what: &str) -> Result<T> {
    let (v, rest) = postcard::take_from_bytes(body)
        .map_err(|e| StateError::corrupt(format!("{what}: undecodable ({e})")))?;
    if !rest.is_empty() {
        return Err(StateError::corrupt(format!("{what}: trailing bytes")));
    }
    Ok(v)
}

/// Decodes a value, checking its checksum and version. `what` names the
/// value in the error.
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    let (_, b) = checked(bytes, what, FORMAT_VERSION)?;
    body(b, what)
}

/// A run record as format 1 lays it out: every field before caps.
#[derive(Serialize, Deserialize)]
struct RunRecordV1 {
    key: RunKey,
    version: u64,
    state: RunState,
    agent_name: String,
    session_id: Option<String>,
    messages_read: u64,
    pending_tool_calls: Vec<ToolCall>,
    usage: Usage,
    cost_micros: u64,
    iterations: u64,
    approval: Option<Approval>,
    created_at: Millis,
    updated_at: Millis,
    seq: u64,
}

/// Encodes a run record: at format 1 when it has no caps and no budget
/// (the layout earlier releases read), else at [`RUN_FORMAT_CAPS`].
pub(crate) fn encode_run(r: &RunRecord) -> Vec<u8> {
    if r.caps.is_none() && r.budget.is_none() {
        let v1 = RunRecordV1 {
            key: r.key.clone(),
            version: r.version,
            state: r.state,
            agent_name: r.agent_name.clone(),
            session_id: r.session_id.clone(),
            messages_read: r.messages_read,
            pending_tool_calls: r.pending_tool_calls.clone(),
            usage: r.usage,
            cost_micros: r.cost_micros,
            iterations: r.iterations,
            approval: r.approval.clone(),
            created_at: r.created_at,
            updated_at: r.updated_at,
            seq: r.seq,
        };
        return encode(&v1);
    }
    let mut out =
        postcard::to_extend(r, vec![RUN_FORMAT_CAPS]).expect("stored types always serialize");
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Decodes a run record of either format.
pub(crate) fn decode_run(bytes: &[u8]) -> Result<RunRecord> {
    let (version, b) = checked(bytes, "run", RUN_FORMAT_CAPS)?;
    if version == RUN_FORMAT_CAPS {
        return body(b, "run");
    }
    let v1: RunRecordV1 = body(b, "run")?;
    Ok(RunRecord {
        key: v1.key,
        version: v1.version,
        state: v1.state,
        agent_name: v1.agent_name,
        session_id: v1.session_id,
        messages_read: v1.messages_read,
        pending_tool_calls: v1.pending_tool_calls,
        usage: v1.usage,
        cost_micros: v1.cost_micros,
        iterations: v1.iterations,
        approval: v1.approval,
        created_at: v1.created_at,
        updated_at: v1.updated_at,
        seq: v1.seq,
        caps: Caps::default(),
        budget: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_flip_is_caught() {
        let v = encode(&("abc".to_string(), 42u64));
        let back: (String, u64) = decode(&v, "t").unwrap();
        assert_eq!(back, ("abc".to_string(), 42));
        for i in 0..v.len() {
            for bit in 0..8 {
                let mut bad = v.clone();
                bad[i] ^= 1 << bit;
                assert!(
                    decode::<(String, u64)>(&bad, "t").is_err(),
                    "flip {i}/{bit}"
                );
            }
        }
        for n in 0..v.len() {
            assert!(decode::<(String, u64)>(&v[..n], "t").is_err());
        }
    }

    #[test]
    fn runs_without_caps_keep_format_1_and_capped_runs_round_trip() {
        let plain = RunRecord::new(RunKey::new("t", "r"), "a");
        let v = encode_run(&plain);
        assert_eq!(v[0], FORMAT_VERSION);
        assert_eq!(decode_run(&v).unwrap(), plain);
        let capped = plain
            .clone()
            .with_caps(Caps::new().cost_micros(5))
            .with_budget("b");
        let v = encode_run(&capped);
        assert_eq!(v[0], RUN_FORMAT_CAPS);
        assert_eq!(decode_run(&v).unwrap(), capped);
        // A generic decode (what a release before caps does) refuses it by
        // name instead of misreading it.
        assert!(matches!(
            decode::<RunRecordV1>(&v, "run"),
            Err(StateError::UnsupportedFormat {
                found: 2,
                supported: 1
            })
        ));
    }

    #[test]
    fn newer_version_is_refused_by_name() {
        let mut v = encode(&7u64);
        v[0] = FORMAT_VERSION + 1;
        let n = v.len() - 4;
        let crc = crc32fast::hash(&v[..n]);
        v[n..].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(
            decode::<u64>(&v, "t"),
            Err(StateError::UnsupportedFormat {
                found: 2,
                supported: 1
            })
        ));
    }
}
