//! The `codec` target: arbitrary bytes decoded as a stored run, session or
//! tray, as a key, or as a cursor never panic; what decodes re-encodes to
//! the same value; keys are injective and keep component order; a cursor
//! decodes only with its own binding and not after any one change (a
//! character replaced, a cut, a character added), and does not show its
//! binding.

use agentstate::fuzz_api::{
    decode_cursor, decode_key, decode_key_greedy, decode_run, decode_session, decode_tray,
    encode_cursor, encode_key, encode_run, encode_session, encode_tray,
};
use agentstate::{
    Approval, Cursor, RunKey, RunRecord, RunState, SessionKey, SessionRecord, ToolCall, Tray, Usage,
};

use super::Input;

fn record(inp: &mut Input<'_>) -> RunRecord {
    let key = RunKey::new(inp.string(12), inp.string(12));
    let mut r = RunRecord::new(key, inp.string(8));
    r.version = inp.u64();
    r.state = inp.pick(&RunState::ALL);
    r.session_id = inp.bool().then(|| inp.string(8));
    r.messages_read = inp.u64();
    for _ in 0..inp.below(3) {
        r.pending_tool_calls.push(ToolCall {
            id: inp.string(6),
            name: inp.string(6),
            arguments: inp.string(24),
        });
    }
    r.usage = Usage {
        input_tokens: inp.u64(),
        output_tokens: inp.u64(),
    };
    r.cost_micros = inp.u64();
    r.iterations = inp.u64();
    r.approval = inp.bool().then(|| Approval {
        id: inp.string(6),
        prompt: inp.string(16),
    });
    r.created_at = inp.u64();
    r.updated_at = inp.u64();
    r.seq = inp.u64();
    r
}

fn components(inp: &mut Input<'_>) -> Vec<String> {
    (0..1 + inp.below(3)).map(|_| inp.string(6)).collect()
}

pub fn run(data: &[u8]) {
    let mut inp = Input::new(data);
    match inp.below(5) {
        // Stored values: garbage never panics; what decodes round-trips.
        0 => {
            let bytes = inp.rest();
            if let Ok(r) = decode_run(bytes) {
                assert_eq!(
                    decode_run(&encode_run(&r)).expect("re-encoded run decodes"),
                    r
                );
            }
            if let Ok(s) = decode_session(bytes) {
                assert_eq!(
                    decode_session(&encode_session(&s)).expect("re-encoded session decodes"),
                    s
                );
            }
            if let Ok(t) = decode_tray(bytes) {
                assert_eq!(
                    decode_tray(&encode_tray(&t)).expect("re-encoded tray decodes"),
                    t
                );
            }
        }
        // Any record round-trips, and any one bit flip is caught (D9).
        1 => {
            let r = record(&mut inp);
            let bytes = encode_run(&r);
            assert_eq!(decode_run(&bytes).expect("encoded run decodes"), r);
            let at = (inp.u64() as usize) % (bytes.len() * 8);
            let mut bad = bytes.clone();
            bad[at / 8] ^= 1 << (at % 8);
            assert!(
                decode_run(&bad).is_err(),
                "bit {at} flipped and the run still decoded"
            );
            assert!(
                decode_run(&bytes[..bytes.len() - 1]).is_err(),
                "truncated run decoded"
            );
            let s = SessionRecord::new(SessionKey::new(inp.string(8), inp.string(8)));
            assert_eq!(
                decode_session(&encode_session(&s)).expect("session decodes"),
                s
            );
            let t = Tray {
                marked: inp.bool(),
                doc: inp.bytes(32).to_vec(),
                env: inp.string(8),
                hostname: inp.string(8),
            };
            assert_eq!(decode_tray(&encode_tray(&t)).expect("tray decodes"), t);
        }
        // Keys: round trip, injective, order-preserving (K6).
        2 => {
            let (a, b) = (components(&mut inp), components(&mut inp));
            let ra: Vec<&str> = a.iter().map(String::as_str).collect();
            let rb: Vec<&str> = b.iter().map(String::as_str).collect();
            let (ka, kb) = (encode_key(&ra), encode_key(&rb));
            assert_eq!(decode_key(&ka, a.len()).expect("key decodes"), a);
            assert_eq!(a == b, ka == kb, "{a:?} and {b:?} share a key");
            assert_eq!(
                a.cmp(&b),
                ka.cmp(&kb),
                "key order differs from component order for {a:?} {b:?}"
            );
        }
        // Garbage keys never panic; a key that reads back whole is the
        // one encoding of its components.
        3 => {
            let bytes = inp.rest();
            let (parts, whole) = decode_key_greedy(bytes);
            if whole {
                let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
                assert_eq!(encode_key(&refs), bytes, "two encodings of {parts:?}");
            }
        }
        // Cursors: bound to their binding, any one change refused, garbage
        // never panics (L6).
        _ => {
            let binding = inp.bytes(16).to_vec();
            // A position is an engine key, never empty (decode refuses an
            // empty one, and encode asserts it round-trips).
            let mut position = inp.bytes(48).to_vec();
            if position.is_empty() {
                position.push(inp.byte());
            }
            let c = encode_cursor(&binding, &position);
            assert_eq!(
                decode_cursor(&binding, &c).expect("own cursor decodes"),
                position
            );
            let mut other = binding.clone();
            other.push(inp.byte());
            assert!(
                decode_cursor(&other, &c).is_err(),
                "cursor accepted with another binding"
            );
            let text = c.as_str();
            // Opaque: the binding (a tenant and filters) is not in the
            // cursor, as text or in the bytes it decodes to.
            if binding.len() >= 8 {
                assert!(
                    !text.as_bytes().windows(binding.len()).any(|w| w == binding),
                    "cursor {text} shows its binding"
                );
            }
            // Any one character replaced by any other printable one, a cut,
            // or one more character: refused.
            let chars: Vec<char> = text.chars().collect();
            let at = (inp.u64() as usize) % chars.len();
            let mut replaced = chars.clone();
            let offset = 1 + inp.below(94) as u8;
            replaced[at] = char::from(0x20 + ((chars[at] as u8 - 0x20 + offset) % 95));
            let cut = inp.below(chars.len());
            let mut extended = text.to_string();
            extended.insert(
                (inp.u64() as usize) % (chars.len() + 1),
                char::from(0x20 + inp.below(95) as u8),
            );
            for bad in [
                replaced.iter().collect::<String>(),
                chars[..cut].iter().collect(),
                extended,
            ] {
                let bad = Cursor::from_text(bad);
                assert!(
                    decode_cursor(&binding, &bad).is_err(),
                    "altered cursor {bad} (from {text}) accepted"
                );
            }
            let garbage = Cursor::from_text(String::from_utf8_lossy(inp.rest()).into_owned());
            let _ = decode_cursor(&binding, &garbage);
        }
    }
}
