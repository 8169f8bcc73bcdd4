//! The `scrub` target: arbitrary JSON and text through the default
//! `Scrubber::scrub_arguments` never panics, is idempotent (X4), and never
//! lets a planted secret through (X3): a GitHub token, an AWS access key
//! id or an `sk-` key, planted as a string value or an object key (alone
//! or as a word of it) anywhere in arbitrary JSON, or as a word anywhere in
//! arbitrary text; and a secret key is renamed, never dropped (an object
//! keeps its number of entries).

use agentstate::Scrubber;
use serde_json::{Map, Value};

use super::Input;

const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
const UPPER_ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
const KEYS: [&str; 8] = [
    "args", "query", "password", "Api-Key", "x", "auth", "note", "url",
];

fn secret(inp: &mut Input<'_>) -> String {
    let kind = inp.byte() % 3;
    let mut draw = |alphabet: &[u8], n: usize| -> String {
        (0..n)
            .map(|_| alphabet[inp.below(alphabet.len())] as char)
            .collect()
    };
    match kind {
        0 => format!("ghp_{}", draw(ALNUM, 36)),
        1 => format!("AKIA{}", draw(UPPER_ALNUM, 16)),
        _ => format!("sk-{}", draw(ALNUM, 32)),
    }
}

/// Arbitrary JSON; the `plant`-th string leaf (counting down) carries the
/// secret as a word of its text.
fn value(inp: &mut Input<'_>, depth: usize, plant: &mut Option<usize>, secret: &str) -> Value {
    let choice = if depth >= 4 {
        inp.below(4)
    } else {
        inp.below(6)
    };
    match choice {
        0 => Value::Null,
        1 => Value::Bool(inp.bool()),
        2 => Value::from(inp.u64() >> inp.below(64)),
        3 => {
            let words = inp.string(12);
            match plant {
                Some(0) => {
                    *plant = None;
                    match inp.below(3) {
                        0 => Value::String(secret.to_string()),
                        1 => Value::String(format!("{} {secret}", words.trim())),
                        _ => Value::String(format!("use {secret} for {}", words.trim())),
                    }
                }
                Some(n) => {
                    *n -= 1;
                    Value::String(words)
                }
                None => Value::String(words),
            }
        }
        4 => Value::Array(
            (0..inp.below(4))
                .map(|_| value(inp, depth + 1, plant, secret))
                .collect(),
        ),
        _ => {
            let mut m = Map::new();
            for _ in 0..inp.below(4) {
                let k = if *plant == Some(0) && inp.below(3) == 0 {
                    // The secret in key position.
                    *plant = None;
                    match inp.below(3) {
                        0 => secret.to_string(),
                        1 => format!("{} {secret}", inp.string(6).trim()),
                        _ => format!("{secret} {}", inp.pick(&KEYS)),
                    }
                } else if inp.bool() {
                    inp.pick(&KEYS).to_string()
                } else {
                    inp.string(8)
                };
                let v = value(inp, depth + 1, plant, secret);
                m.insert(k, v);
            }
            Value::Object(m)
        }
    }
}

pub fn run(data: &[u8]) {
    let scrubber = Scrubber::default();
    let mut inp = Input::new(data);
    let mode = inp.below(3);
    let (text, planted) = match mode {
        // Arbitrary text, no plant: no panic, idempotent.
        0 => (String::from_utf8_lossy(inp.rest()).into_owned(), None),
        // Arbitrary JSON with a planted secret.
        1 => {
            let s = secret(&mut inp);
            let mut plant = Some(inp.below(8));
            let mut v = value(&mut inp, 0, &mut plant, &s);
            if plant.is_some() {
                v = Value::Array(vec![v, Value::String(s.clone())]);
            }
            let text = if inp.bool() {
                serde_json::to_string_pretty(&v)
            } else {
                serde_json::to_string(&v)
            };
            (text.expect("a Value always serializes"), Some(s))
        }
        // Arbitrary text with the secret as a word somewhere in it.
        _ => {
            let s = secret(&mut inp);
            let text = String::from_utf8_lossy(inp.rest()).into_owned();
            let mut at = text.len() / 2;
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            (format!("{} {s} {}", &text[..at], &text[at..]), Some(s))
        }
    };
    let once = scrubber.scrub_arguments(&text);
    let twice = scrubber.scrub_arguments(&once);
    assert_eq!(once, twice, "scrubbing is not idempotent on {text:?}");
    if let Some(s) = planted {
        assert!(
            !once.contains(&s),
            "planted secret {s} survived scrubbing of {text:?}: {once:?}"
        );
    }
    // No entry is lost: a scrubbed key is renamed, unique in its object.
    if let (Ok(Value::Object(before)), Ok(Value::Object(after))) = (
        serde_json::from_str::<Value>(&text),
        serde_json::from_str::<Value>(&once),
    ) {
        assert_eq!(
            before.len(),
            after.len(),
            "an entry was lost scrubbing {text:?}: {once:?}"
        );
    }
}
