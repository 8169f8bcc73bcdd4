//! The value codec (rules D4, D9): a format-version byte, the postcard
//! encoding, then a CRC-32 of both.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use super::crc;
use crate::budget::Caps;
use crate::error::{Result, StateError};
use crate::labels::Labels;
use crate::record::{
    Approval, Millis, RunKey, RunRecord, RunState, SessionKey, SessionRecord, ToolCall, Usage,
};

/// The format this build writes. A value with a higher version was written
/// by a newer release and is refused.
pub const FORMAT_VERSION: u8 = 1;
/// Version byte plus checksum.
pub const OVERHEAD_BYTES: usize = 1 + 4;

/// Encodes `v` behind the version byte, with a trailing checksum.
#[allow(clippy::expect_used, reason = "stored types always serialize")]
pub fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // postcard's std serializer only fails on types serde cannot express,
    // and every stored type is plain data.
    // Sized first: one allocation, instead of a dozen regrowths for a run.
    let size = postcard::experimental::serialized_size(v).expect("stored types always serialize");
    let mut buf = Vec::with_capacity(OVERHEAD_BYTES + size);
    buf.push(FORMAT_VERSION);
    let mut out = postcard::to_extend(v, buf).expect("stored types always serialize");
    let crc = crc::crc32(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// `out` with its checksum appended.
fn with_checksum(mut out: Vec<u8>) -> Vec<u8> {
    let crc = crc::crc32(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// The format of run records that carry caps or a budget (rule B1). A run
/// without either is written at [`FORMAT_VERSION`], byte for byte as
/// earlier releases wrote it, so a store that never uses caps stays
/// readable by them; a release that predates caps refuses a capped run
/// with `UnsupportedFormat` instead of misreading it.
pub const RUN_FORMAT_CAPS: u8 = 2;
/// The format of run records that carry labels (rule R11): format 2's
/// fields, then the labels. Written only for a run with labels, so a store
/// that never uses them stays readable by releases before them.
pub const RUN_FORMAT_LABELS: u8 = 3;
/// The format of sessions with labels: format 1's fields, then the labels.
pub const SESSION_FORMAT_LABELS: u8 = 2;

/// Checks the checksum and the version byte; returns the version and the
/// postcard body. Also for stores with their own layouts of a value (the
/// Redis backend's heads and tails), which number their formats apart.
pub fn checked<'a>(bytes: &'a [u8], what: &str, newest: u8) -> Result<(u8, &'a [u8])> {
    if bytes.len() < OVERHEAD_BYTES {
        return Err(StateError::corrupt(format!("{what}: value truncated")));
    }
    let Some((body, crc)) = bytes.split_last_chunk::<4>() else {
        return Err(StateError::corrupt(format!("{what}: value truncated")));
    };
    let crc = u32::from_le_bytes(*crc);
    if crc::crc32(body) != crc {
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

/// Decodes a postcard body (after [`checked`]); nothing may follow.
pub fn body<T: DeserializeOwned>(body: &[u8], what: &str) -> Result<T> {
    let (v, rest) = postcard::take_from_bytes(body)
        .map_err(|e| StateError::corrupt(format!("{what}: undecodable ({e})")))?;
    if !rest.is_empty() {
        return Err(StateError::corrupt(format!("{what}: trailing bytes")));
    }
    Ok(v)
}

/// Decodes a value, checking its checksum and version. `what` names the
/// value in the error.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    let (_, b) = checked(bytes, what, FORMAT_VERSION)?;
    body(b, what)
}

/// A run record as format 1 lays it out: every field before caps. The
/// serde reference of the format-1 decode (`decode_run` reads it by hand).
#[cfg(test)]
#[derive(Deserialize, Serialize)]
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
/// clone of every string and tool call. The serde reference of the
/// format-1 encode (`encode_run` writes it by hand).
#[cfg(test)]
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

/// A run record as format 2 lays it out: format 1's fields, then caps
/// and budget (postcard writes a nested struct's fields in line).
#[cfg(test)]
#[derive(Deserialize)]
struct RunRecordV2 {
    v1: RunRecordV1,
    caps: Caps,
    budget: Option<String>,
}

/// [`RunRecordV2`] borrowed from a record, for writing.
#[cfg(test)]
#[derive(Serialize)]
struct RunRecordV2Ref<'a> {
    v1: RunRecordV1Ref<'a>,
    caps: &'a Caps,
    budget: &'a Option<String>,
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
    let labels: usize = r
        .labels
        .iter()
        .map(|(k, v)| text(k) + text(&crate::labels::canonical(v)))
        .sum::<usize>()
        + 10;
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
        + labels
        + 400
}

/// The fields every run format starts with (the serde reference's).
#[cfg(test)]
fn v1_ref(r: &RunRecord) -> RunRecordV1Ref<'_> {
    RunRecordV1Ref {
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
    }
}

/// Encodes a run record: at format 1 when it has no caps and no budget
/// (the layout earlier releases read), else at [`RUN_FORMAT_CAPS`].
///
/// Written by hand by `RunWriter`, as `decode_run` reads by hand: the
/// bytes are postcard's, exactly (the serde encoder stays the reference,
/// and the tests hold the two to the same bytes), at a fraction of the
/// instructions serde's per-field calls cost on every create and update.
pub fn encode_run(r: &RunRecord) -> Vec<u8> {
    encode_run_at(r, r.seq)
}

/// [`encode_run`] with `seq` in place of the record's: the PostgreSQL
/// store writes 0 there and keeps the seq in its row's column, which the
/// server assigns in the write's own statement.
pub fn encode_run_at(r: &RunRecord, seq: u64) -> Vec<u8> {
    let mut w = RunWriter {
        out: Vec::with_capacity(run_size_bound(r)),
    };
    let format = run_format(r);
    w.out.push(format);
    w.run(r, format, seq);
    with_checksum(w.out)
}

/// The oldest format that holds all of `r`.
fn run_format(r: &RunRecord) -> u8 {
    if !r.labels.is_empty() {
        RUN_FORMAT_LABELS
    } else if !(r.caps.is_none() && r.budget.is_none()) {
        RUN_FORMAT_CAPS
    } else {
        FORMAT_VERSION
    }
}

/// The serde encoding of a run record: the reference [`encode_run`] is
/// held to.
#[cfg(test)]
fn encode_run_serde(r: &RunRecord) -> Vec<u8> {
    let mut buf = Vec::new();
    let format = run_format(r);
    let mut out = if format == FORMAT_VERSION {
        buf.push(FORMAT_VERSION);
        let v1 = v1_ref(r);
        postcard::to_extend(&v1, buf)
    } else if format == RUN_FORMAT_CAPS {
        buf.push(RUN_FORMAT_CAPS);
        let v2 = RunRecordV2Ref {
            v1: v1_ref(r),
            caps: &r.caps,
            budget: &r.budget,
        };
        postcard::to_extend(&v2, buf)
    } else {
        buf.push(RUN_FORMAT_LABELS);
        postcard::to_extend(r, buf)
    }
    .expect("stored types always serialize");
    let crc = crc::crc32(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// A writer of postcard's encoding, just for run records: varints for
/// numbers, lengths and enum variants, length-prefixed strings and
/// sequences, one-byte option tags, struct fields in declaration order.
struct RunWriter {
    out: Vec<u8>,
}

impl RunWriter {
    #[inline(always)]
    fn u64(&mut self, n: u64) {
        // Most fields are small: one byte, no loop.
        if n < 0x80 {
            self.out.push(n as u8);
        } else {
            self.varint(n);
        }
    }

    #[inline(never)]
    fn varint(&mut self, mut n: u64) {
        let mut buf = [0u8; 10];
        let mut i = 0;
        while n >= 0x80 {
            buf[i] = (n as u8) | 0x80;
            n >>= 7;
            i += 1;
        }
        buf[i] = n as u8;
        self.out.extend_from_slice(&buf[..=i]);
    }

    #[inline]
    fn string(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.out.extend_from_slice(s.as_bytes());
    }

    #[inline]
    fn option<T>(&mut self, v: Option<T>, some: impl FnOnce(&mut Self, T)) {
        match v {
            None => self.out.push(0),
            Some(v) => {
                self.out.push(1);
                some(self, v);
            }
        }
    }

    /// The record: format 1's fields, then from format 2 its caps and
    /// budget, and at format 3 its labels.
    fn run(&mut self, r: &RunRecord, format: u8, seq: u64) {
        self.string(&r.key.tenant);
        self.string(&r.key.run_id);
        self.u64(r.version);
        self.u64(u64::from(r.state.tag()));
        self.string(&r.agent_name);
        self.option(r.session_id.as_deref(), Self::string);
        self.u64(r.messages_read);
        self.u64(r.pending_tool_calls.len() as u64);
        for c in &r.pending_tool_calls {
            self.string(&c.id);
            self.string(&c.name);
            self.string(&c.arguments);
        }
        self.u64(r.usage.input_tokens);
        self.u64(r.usage.output_tokens);
        self.u64(r.cost_micros);
        self.u64(r.iterations);
        self.option(r.approval.as_ref(), |w, a| {
            w.string(&a.id);
            w.string(&a.prompt);
        });
        self.u64(r.created_at);
        self.u64(r.updated_at);
        self.u64(seq);
        if format >= RUN_FORMAT_CAPS {
            self.option(r.caps.cost_micros_max, Self::u64);
            self.option(r.caps.tokens_max, Self::u64);
            self.option(r.caps.iterations_max, Self::u64);
            self.option(r.budget.as_deref(), Self::string);
        }
        if format >= RUN_FORMAT_LABELS {
            // As serde writes a map of strings: its length, then each key
            // and the value's canonical JSON text.
            self.u64(r.labels.len() as u64);
            for (k, v) in r.labels.iter() {
                self.string(k);
                self.string(&crate::labels::canonical(v));
            }
        }
    }
}

/// Decodes a run record of either format.
///
/// Read straight from the slice by `RunReader` rather than through
/// serde: a page decodes a hundred records, and serde's visitor for each
/// field cost more than the rest of the decode (the allocations aside).
/// The bytes are postcard's, exactly as `encode_run` writes them; the
/// serde decoder stays the reference, and the tests hold the two to the
/// same answer for every input.
pub fn decode_run(bytes: &[u8]) -> Result<RunRecord> {
    let (version, b) = checked(bytes, "run", RUN_FORMAT_LABELS)?;
    RunReader { b }
        .run(version)
        .map_err(|why| StateError::corrupt(format!("run: undecodable ({why})")))
}

/// The run id of an encoded run record (its second field), read without
/// decoding the rest: the change feed keeps it beside the run's entry, for
/// the tombstone a delete leaves.
///
/// The checksum is not checked: the bytes are a write of this process,
/// made by the encoder moments ago (the change feed's group leader).
pub fn run_id_of(bytes: &[u8]) -> Result<String> {
    let b = bytes.get(1..).unwrap_or_default();
    let mut r = RunReader { b };
    r.str()
        .and_then(|_tenant| r.string())
        .map_err(|why| StateError::corrupt(format!("run: undecodable ({why})")))
}

/// Why a run record's body does not decode.
type Undecodable = &'static str;

/// A reader of postcard's encoding (varints, length-prefixed strings and
/// sequences, one-byte option tags, enum variants as varint indexes), just
/// for run records: what postcard refuses it refuses, and it accepts what
/// postcard accepts, to the same value.
struct RunReader<'a> {
    b: &'a [u8],
}

impl<'a> RunReader<'a> {
    fn byte(&mut self) -> std::result::Result<u8, Undecodable> {
        let (&x, rest) = self.b.split_first().ok_or("unexpected end")?;
        self.b = rest;
        Ok(x)
    }

    /// A varint of at most `max` bytes whose last byte is at most `last`
    /// (postcard's bounds: 10 and 1 for a u64, 5 and 15 for a u32).
    #[inline]
    fn varint(&mut self, max: u32, last: u8) -> std::result::Result<u64, Undecodable> {
        let mut out = 0u64;
        for i in 0..max {
            let v = self.byte()?;
            out |= u64::from(v & 0x7f) << (7 * i);
            if v & 0x80 == 0 {
                return if i == max - 1 && v > last {
                    Err("bad varint")
                } else {
                    Ok(out)
                };
            }
        }
        Err("bad varint")
    }

    fn u64(&mut self) -> std::result::Result<u64, Undecodable> {
        // Most fields are small: one byte, no loop.
        match self.b.first() {
            Some(&v) if v < 0x80 => {
                self.b = &self.b[1..];
                Ok(u64::from(v))
            }
            _ => self.varint(10, 1),
        }
    }

    fn len(&mut self) -> std::result::Result<usize, Undecodable> {
        // postcard reads a usize as a u64 on a 64-bit target; on a smaller
        // one a length past usize is past the end of the slice anyway.
        Ok(usize::try_from(self.u64()?).unwrap_or(usize::MAX))
    }

    fn string(&mut self) -> std::result::Result<String, Undecodable> {
        self.str().map(str::to_owned)
    }

    /// A string, borrowed from the bytes (checked as [`string`](Self::string)'s).
    fn str(&mut self) -> std::result::Result<&'a str, Undecodable> {
        let n = self.len()?;
        if n > self.b.len() {
            return Err("unexpected end");
        }
        let (s, rest) = self.b.split_at(n);
        self.b = rest;
        std::str::from_utf8(s).map_err(|_| "bad utf-8")
    }

    fn option<T>(
        &mut self,
        some: impl FnOnce(&mut Self) -> std::result::Result<T, Undecodable>,
    ) -> std::result::Result<Option<T>, Undecodable> {
        match self.byte()? {
            0 => Ok(None),
            1 => some(self).map(Some),
            _ => Err("bad option tag"),
        }
    }

    fn state(&mut self) -> std::result::Result<RunState, Undecodable> {
        let i = self.varint(5, 0x0f)?;
        usize::try_from(i)
            .ok()
            .and_then(|i| RunState::ALL.get(i).copied())
            .ok_or("unknown run state")
    }

    fn tool_calls(&mut self) -> std::result::Result<Vec<ToolCall>, Undecodable> {
        let n = self.len()?;
        // Each call is at least three bytes: never reserve for more calls
        // than the bytes left could hold.
        let mut calls = Vec::with_capacity(n.min(self.b.len() / 3));
        for _ in 0..n {
            calls.push(ToolCall {
                id: self.string()?,
                name: self.string()?,
                arguments: self.string()?,
            });
        }
        Ok(calls)
    }

    /// The record: format 1's fields, then from format 2 its caps and
    /// budget, at format 3 its labels; nothing may follow.
    fn run(mut self, format: u8) -> std::result::Result<RunRecord, Undecodable> {
        let key = RunKey {
            tenant: self.string()?,
            run_id: self.string()?,
        };
        let mut r = RunRecord {
            key,
            version: self.u64()?,
            state: self.state()?,
            agent_name: self.string()?,
            session_id: self.option(Self::string)?,
            messages_read: self.u64()?,
            pending_tool_calls: self.tool_calls()?,
            usage: Usage {
                input_tokens: self.u64()?,
                output_tokens: self.u64()?,
            },
            cost_micros: self.u64()?,
            iterations: self.u64()?,
            approval: self.option(|r| {
                Ok(Approval {
                    id: r.string()?,
                    prompt: r.string()?,
                })
            })?,
            created_at: self.u64()?,
            updated_at: self.u64()?,
            seq: self.u64()?,
            caps: Caps::default(),
            budget: None,
            labels: Labels::new(),
        };
        if format >= RUN_FORMAT_CAPS {
            r.caps = Caps {
                cost_micros_max: self.option(Self::u64)?,
                tokens_max: self.option(Self::u64)?,
                iterations_max: self.option(Self::u64)?,
            };
            r.budget = self.option(Self::string)?;
        }
        if format >= RUN_FORMAT_LABELS {
            let n = self.len()?;
            for _ in 0..n {
                let k = self.string()?;
                let text = self.string()?;
                let v = serde_json::from_str(&text).map_err(|_| "bad label value")?;
                r.labels.insert(k, v);
            }
        }
        if !self.b.is_empty() {
            return Err("trailing bytes");
        }
        Ok(r)
    }
}

/// Decodes a run record of either format through serde: the reference
/// [`decode_run`] is held to.
#[cfg(test)]
fn decode_run_serde(bytes: &[u8]) -> Result<RunRecord> {
    let (version, b) = checked(bytes, "run", RUN_FORMAT_LABELS)?;
    if version == RUN_FORMAT_LABELS {
        return body(b, "run");
    }
    let (v1, caps, budget) = if version == RUN_FORMAT_CAPS {
        let v2: RunRecordV2 = body(b, "run")?;
        (v2.v1, v2.caps, v2.budget)
    } else {
        (body::<RunRecordV1>(b, "run")?, Caps::default(), None)
    };
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
        caps,
        budget,
        labels: Labels::new(),
    })
}

/// A session as format 1 lays it out: every field before labels.
#[derive(Serialize)]
struct SessionV1Ref<'a> {
    key: &'a SessionKey,
    version: u64,
    metadata: &'a BTreeMap<String, String>,
    created_at: Millis,
    updated_at: Millis,
}

/// [`SessionV1Ref`], owned, for reading.
#[derive(Deserialize)]
struct SessionV1 {
    key: SessionKey,
    version: u64,
    metadata: BTreeMap<String, String>,
    created_at: Millis,
    updated_at: Millis,
}

/// Encodes a session: at format 1 when it has no labels (the layout
/// earlier releases read), else at [`SESSION_FORMAT_LABELS`].
#[allow(clippy::expect_used, reason = "stored types always serialize")]
pub fn encode_session(s: &SessionRecord) -> Vec<u8> {
    if !s.labels.is_empty() {
        let out = postcard::to_extend(s, vec![SESSION_FORMAT_LABELS])
            .expect("stored types always serialize");
        return with_checksum(out);
    }
    encode(&SessionV1Ref {
        key: &s.key,
        version: s.version,
        metadata: &s.metadata,
        created_at: s.created_at,
        updated_at: s.updated_at,
    })
}

/// Decodes a session of either format.
pub fn decode_session(bytes: &[u8]) -> Result<SessionRecord> {
    let (version, b) = checked(bytes, "session", SESSION_FORMAT_LABELS)?;
    if version == SESSION_FORMAT_LABELS {
        return body(b, "session");
    }
    let v1: SessionV1 = body(b, "session")?;
    Ok(SessionRecord {
        key: v1.key,
        version: v1.version,
        metadata: v1.metadata,
        created_at: v1.created_at,
        updated_at: v1.updated_at,
        labels: Labels::new(),
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

    /// A run with every field set, strings of `n` bytes (some not ASCII),
    /// `calls` tool calls, capped or not.
    fn full_run(n: usize, calls: usize, capped: bool) -> RunRecord {
        let text = |c: char| c.to_string().repeat(n);
        let mut r = RunRecord::new(RunKey::new(text('t'), text('é')), text('a'));
        r.session_id = Some(text('s'));
        r.state = RunState::ALL[n % RunState::ALL.len()];
        r.pending_tool_calls = (0..calls)
            .map(|i| ToolCall {
                id: format!("call_{i}"),
                name: text('n'),
                arguments: text('{'),
            })
            .collect();
        r.approval = Some(Approval {
            id: text('i'),
            prompt: text('☃'),
        });
        (r.version, r.messages_read, r.cost_micros, r.iterations) = (u64::MAX, 127, 128, 1 << 35);
        (r.created_at, r.updated_at, r.seq) = (1, u64::MAX - 1, 16_384);
        r.usage = Usage {
            input_tokens: 300,
            output_tokens: u64::MAX,
        };
        if capped {
            r = r
                .with_caps(Caps {
                    cost_micros_max: Some(u64::MAX),
                    tokens_max: None,
                    iterations_max: Some(0),
                })
                .with_budget(text('b'));
            // Odd sizes also carry labels: format 3.
            if n % 2 == 1 {
                r = r
                    .with_label(text('k'), text('l'))
                    .with_label("n", n)
                    .with_label("o", serde_json::json!({"z": [n], "a": null}));
            }
        }
        r
    }

    /// `body` behind `version` with a checksum that matches, so the body
    /// decoder itself answers.
    fn sealed(version: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![version];
        v.extend_from_slice(body);
        let crc = crc32fast::hash(&v);
        v.extend_from_slice(&crc.to_le_bytes());
        v
    }

    /// The hand decoder and the serde one agree: same record, or both refuse.
    fn agree(bytes: &[u8]) {
        match (decode_run(bytes), decode_run_serde(bytes)) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{bytes:02x?}"),
            (Err(a), Err(b)) => assert_eq!(
                std::mem::discriminant(&a),
                std::mem::discriminant(&b),
                "{a} / {b}"
            ),
            (a, b) => panic!("hand {a:?} vs serde {b:?} on {bytes:02x?}"),
        }
    }

    /// The hand encoder writes serde's bytes.
    fn same_bytes(r: &RunRecord) {
        let v = encode_run(r);
        assert_eq!(v, encode_run_serde(r), "{r:?}");
        assert!(v.len() <= run_size_bound(r), "{} > bound", v.len());
    }

    #[test]
    fn the_hand_encoder_writes_what_serde_writes() {
        for capped in [false, true] {
            for (n, calls) in [
                (0, 0),
                (1, 1),
                (5, 3),
                (70, 2),
                (127, 1),
                (128, 1),
                (200, 1),
            ] {
                let mut r = full_run(n, calls, capped);
                same_bytes(&r);
                for state in RunState::ALL {
                    r.state = state;
                    same_bytes(&r);
                }
                // Every varint length, the 10-byte u64 included.
                for shift in 0..64 {
                    for n in [1u64 << shift, (1u64 << shift) - 1, u64::MAX >> shift] {
                        (r.version, r.seq, r.usage.input_tokens) = (n, n, n);
                        r.caps.tokens_max = capped.then_some(n);
                        same_bytes(&r);
                    }
                }
                r.session_id = None;
                r.approval = None;
                r.budget = None;
                same_bytes(&r);
            }
        }
        same_bytes(&RunRecord::new(RunKey::new("", ""), ""));
    }

    #[test]
    fn the_hand_decoder_reads_what_serde_reads() {
        for capped in [false, true] {
            for (n, calls) in [(0, 0), (1, 1), (5, 3), (70, 2), (200, 1)] {
                let r = full_run(n, calls, capped);
                let v = encode_run(&r);
                assert_eq!(decode_run(&v).unwrap(), r);
                agree(&v);
                let body = &v[1..v.len() - 4];
                // Every truncation, every byte changed to a few telling
                // values, and a trailing byte, all behind a good checksum,
                // in both formats.
                for version in [FORMAT_VERSION, RUN_FORMAT_CAPS, RUN_FORMAT_LABELS] {
                    for cut in 0..body.len() {
                        agree(&sealed(version, &body[..cut]));
                    }
                    for i in 0..body.len() {
                        for x in [0x00, 0x01, 0x02, 0x0f, 0x10, 0x7f, 0x80, 0xc3, 0xff] {
                            let mut b = body.to_vec();
                            b[i] = x;
                            agree(&sealed(version, &b));
                        }
                    }
                    let mut b = body.to_vec();
                    b.push(0);
                    agree(&sealed(version, &b));
                }
            }
        }
    }

    #[test]
    fn varints_at_their_bounds_decode_as_postcard_does() {
        // The version field (the first after the key) spelled every way
        // postcard reads or refuses a u64: overlong forms, the 10-byte
        // maximum, a tenth byte past 1, an eleventh byte.
        let key = [1, b't', 1, b'r'];
        let rest = [
            0, 1, b'a', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // state … seq
        ];
        let spellings: [&[u8]; 7] = [
            &[0x80, 0x00],
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02],
            &[
                0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00,
            ],
            &[0x85, 0x80, 0x80, 0x80, 0x00],
            &[0x80],
            &[],
        ];
        for version in spellings {
            let body = [&key[..], version, &rest[..]].concat();
            agree(&sealed(FORMAT_VERSION, &body));
        }
        let ok = [&key[..], &[0x80, 0x00], &rest[..]].concat();
        assert_eq!(decode_run(&sealed(FORMAT_VERSION, &ok)).unwrap().version, 0);
        // A state index past the last state, and at a u32's bounds.
        for state in [
            &[7u8][..],
            &[0x80, 0x80, 0x80, 0x80, 0x0f],
            &[0x80, 0x80, 0x80, 0x80, 0x10],
        ] {
            let body = [&key[..], &[0], state, &rest[1..]].concat();
            agree(&sealed(FORMAT_VERSION, &body));
        }
    }

    proptest::proptest! {
        #[test]
        fn any_body_decodes_alike(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..96),
                                  format in 1u8..=3) {
            agree(&sealed(format, &body));
        }

        #[test]
        fn any_run_encodes_as_serde_does(n in 0usize..300, calls in 0usize..4, capped in proptest::prelude::any::<bool>(),
                                         nums in proptest::prelude::any::<[u64; 4]>()) {
            let mut r = full_run(n, calls, capped);
            (r.version, r.messages_read, r.cost_micros, r.seq) = (nums[0], nums[1], nums[2], nums[3]);
            r.caps.iterations_max = capped.then_some(nums[0] >> (nums[1] % 64));
            same_bytes(&r);
        }

        #[test]
        fn any_run_round_trips(n in 0usize..40, calls in 0usize..4, capped in proptest::prelude::any::<bool>(),
                               flip in proptest::prelude::any::<(usize, u8)>()) {
            let v = encode_run(&full_run(n, calls, capped));
            agree(&v);
            let mut body = v[1..v.len() - 4].to_vec();
            let i = flip.0 % body.len();
            body[i] ^= flip.1;
            agree(&sealed(v[0], &body));
        }
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

#[cfg(test)]
mod label_format_tests {
    use super::*;

    #[test]
    fn runs_and_sessions_without_labels_keep_their_old_formats() {
        let plain = RunRecord::new(RunKey::new("t", "r"), "a");
        assert_eq!(encode_run(&plain)[0], FORMAT_VERSION);
        let capped = plain.clone().with_budget("b");
        assert_eq!(encode_run(&capped)[0], RUN_FORMAT_CAPS);
        let labelled = plain.with_label("user", "u-1");
        let v = encode_run(&labelled);
        assert_eq!(v[0], RUN_FORMAT_LABELS);
        assert_eq!(decode_run(&v).unwrap(), labelled);

        let s = SessionRecord::new(SessionKey::new("t", "s"));
        let v = encode_session(&s);
        assert_eq!(v[0], FORMAT_VERSION);
        // Format 1 is the layout earlier releases wrote: serde's encoding
        // of the session without its labels.
        assert_eq!(
            v,
            encode(&SessionV1Ref {
                key: &s.key,
                version: 0,
                metadata: &s.metadata,
                created_at: 0,
                updated_at: 0,
            })
        );
        assert_eq!(decode_session(&v).unwrap(), s);
        let s = s.with_label("title", "hi");
        let v = encode_session(&s);
        assert_eq!(v[0], SESSION_FORMAT_LABELS);
        assert_eq!(decode_session(&v).unwrap(), s);
        // A release before labels refuses the new format by name.
        assert!(matches!(
            decode::<SessionV1>(&v, "session"),
            Err(StateError::UnsupportedFormat { found: 2, .. })
        ));
    }
}
