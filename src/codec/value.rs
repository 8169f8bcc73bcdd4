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
    // Sized first: one allocation, instead of a dozen regrowths for a run.
    let size = postcard::experimental::serialized_size(v).expect("stored types always serialize");
    let mut buf = Vec::with_capacity(OVERHEAD_BYTES + size);
    buf.push(FORMAT_VERSION);
    let mut out = postcard::to_extend(v, buf).expect("stored types always serialize");
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
#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
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

/// [`RunRecordV1`] borrowed from a record, for writing: serde writes a
/// reference as what it points at, so the bytes are the same, without a
/// clone of every string and tool call.
#[derive(Serialize)]
struct RunRecordV1Ref<'a> {
    key: &'a RunKey,
    version: u64,
    state: RunState,
    agent_name: &'a str,
    session_id: &'a Option<String>,
    messages_read: u64,
    pending_tool_calls: &'a [ToolCall],
    usage: Usage,
    cost_micros: u64,
    iterations: u64,
    approval: &'a Option<Approval>,
    created_at: Millis,
    updated_at: Millis,
    seq: u64,
}

/// At least the encoded size of a run record, counted from its strings
/// (a length prefix of at most 10 bytes each) and its fixed fields, so the
/// buffer is allocated once without encoding the record twice.
fn run_size_bound(r: &RunRecord) -> usize {
    let text = |s: &str| s.len() + 10;
    let opt = |s: &Option<String>| 1 + s.as_deref().map_or(0, text);
    let calls: usize = r
        .pending_tool_calls
        .iter()
        .map(|c| text(&c.id) + text(&c.name) + text(&c.arguments))
        .sum();
    let approval = 1 + r
        .approval
        .as_ref()
        .map_or(0, |a| text(&a.id) + text(&a.prompt));
    let budget = opt(&r.budget);
    // Every other field is a number, an enum tag or an option of numbers:
    // 40 of them at 10 bytes each covers the record and its caps.
    OVERHEAD_BYTES
        + text(&r.key.tenant)
        + text(&r.key.run_id)
        + text(&r.agent_name)
        + opt(&r.session_id)
        + 10
        + calls
        + approval
        + budget
        + 400
}

/// Encodes a run record: at format 1 when it has no caps and no budget
/// (the layout earlier releases read), else at [`RUN_FORMAT_CAPS`].
pub(crate) fn encode_run(r: &RunRecord) -> Vec<u8> {
    let mut buf = Vec::with_capacity(run_size_bound(r));
    let mut out = if r.caps.is_none() && r.budget.is_none() {
        buf.push(FORMAT_VERSION);
        let v1 = RunRecordV1Ref {
            key: &r.key,
            version: r.version,
            state: r.state,
            agent_name: &r.agent_name,
            session_id: &r.session_id,
            messages_read: r.messages_read,
            pending_tool_calls: &r.pending_tool_calls,
            usage: r.usage,
            cost_micros: r.cost_micros,
            iterations: r.iterations,
            approval: &r.approval,
            created_at: r.created_at,
            updated_at: r.updated_at,
            seq: r.seq,
        };
        postcard::to_extend(&v1, buf)
    } else {
        buf.push(RUN_FORMAT_CAPS);
        postcard::to_extend(r, buf)
    }
    .expect("stored types always serialize");
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
    fn borrowed_format_1_writes_the_owned_layout_and_the_bound_holds() {
        let mut r = RunRecord::new(RunKey::new("acme", "run-1"), "planner");
        r.session_id = Some("s".repeat(300));
        r.pending_tool_calls = (0..3)
            .map(|i| ToolCall {
                id: format!("call_{i}"),
                name: "web_search".into(),
                arguments: "{\"q\":1}".repeat(i * 50),
            })
            .collect();
        r.approval = Some(Approval {
            id: "ap".into(),
            prompt: "ok?".into(),
        });
        (r.version, r.seq, r.created_at, r.updated_at) = (u64::MAX, u64::MAX, u64::MAX, 7);
        r.usage.input_tokens = u64::MAX;
        let v = encode_run(&r);
        let owned = RunRecordV1 {
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
        assert_eq!(v, encode(&owned), "format 1 bytes changed");
        assert!(v.len() <= run_size_bound(&r), "{} > bound", v.len());
        assert_eq!(decode_run(&v).unwrap(), r);
        let capped = r
            .with_caps(Caps::new().cost_micros(u64::MAX))
            .with_budget("b".repeat(100));
        let v = encode_run(&capped);
        assert!(v.len() <= run_size_bound(&capped), "{} > bound", v.len());
        assert_eq!(decode_run(&v).unwrap(), capped);
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
