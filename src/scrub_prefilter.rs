//! The scrubber's prefilter: one cheap pass that tells when the default
//! rules cannot change a tool call's arguments, so the common clean argument
//! skips the JSON parse and the rule regexes.
//!
//! [`may_hold_secret`] is conservative: it answers `true` for every text the
//! full rules could redact anything in, and may answer `true` for others.
//! It looks for what every rule needs to see, in two forms of the text:
//!
//! - the raw text, for the secret shapes: each shape's match holds a fixed
//!   piece (`sk-`, `ghp_`, `xox`, `AKIA`, `eyJ`, `-----BEGIN`, `://` with an
//!   `@` somewhere, …) that JSON can only spell differently with a `\u`
//!   escape — and any `\u` escape makes the answer `true`;
//! - the text's *skeleton*: every character mapped as the key rule
//!   normalizes a key (lower-cased; `_`, `-`, `.` and whitespace dropped),
//!   once as written and once with JSON's escapes read (`\t` is whitespace
//!   there). A key or a `key=value` pair that names a secret normalizes to
//!   something ending with a secret word, and the mapping is one character
//!   at a time, so that word is a substring of the skeleton; the word list
//!   here holds a piece of every secret word (`pass`, `pw`, `secret`,
//!   `token`, `auth`, `cred`, `cookie`, `apikey`, …).
//!
//! A text that holds none of these reaches the rules unchanged: the
//! property test below runs generated texts (JSON and not, secrets as
//! values, as keys and as words) through both and checks it.

use std::sync::LazyLock;

use aho_corasick::AhoCorasick;

/// Pieces of the raw text that every secret shape's match contains.
const SHAPE_PIECES: &[&str] = &[
    // PEM private-key block.
    "-----BEGIN",
    // OpenAI / Anthropic (`sk-`), Stripe (`sk_`, `rk_`, `whsec_`).
    "sk-",
    "sk_",
    "rk_",
    "whsec_",
    // GitHub.
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "github_pat_",
    // Slack.
    "xox",
    "xapp-",
    // AWS access key ids.
    "AKIA",
    "ASIA",
    // JWT / JWE.
    "eyJ",
    // Google API key.
    "AIza",
    // Any JSON `\u` escape can spell any of these (or a key) differently.
    "\\u",
];

/// Pieces of the skeleton (normalized text) that every secret key word and
/// the bearer shape contain.
const KEY_PIECES: &[&str] = &[
    "pass",
    "pw",
    "secret",
    "token",
    "apikey",
    "privatekey",
    "privkey",
    "accesskey",
    "signingkey",
    "encryptionkey",
    "masterkey",
    "auth",
    "cred",
    "cookie",
    "bearer",
    "jwt",
];

/// A multi-substring finder: the SIMD one (Teddy) where the CPU has it,
/// else an Aho-Corasick DFA.
enum Finder {
    Packed(aho_corasick::packed::Searcher),
    Dfa(AhoCorasick),
}

impl Finder {
    fn new(pieces: &[&str]) -> Finder {
        match aho_corasick::packed::Searcher::new(pieces.iter()) {
            Some(s) => Finder::Packed(s),
            None => Finder::Dfa(
                AhoCorasick::builder()
                    .kind(Some(aho_corasick::AhoCorasickKind::DFA))
                    .build(pieces)
                    .expect("prefilter pieces build"),
            ),
        }
    }

    fn is_match(&self, haystack: &[u8]) -> bool {
        match self {
            Finder::Packed(s) => s.find(haystack).is_some(),
            Finder::Dfa(ac) => ac.is_match(haystack),
        }
    }
}

static SHAPES: LazyLock<Finder> = LazyLock::new(|| Finder::new(SHAPE_PIECES));
static KEYS: LazyLock<Finder> = LazyLock::new(|| Finder::new(KEY_PIECES));

/// The skeleton of each ASCII byte: its lower case, or 0 when the key rule
/// drops it (`_`, `-`, `.`, whitespace).
static ASCII_SKELETON: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        // `char::is_whitespace` on ASCII: tab, LF, VT, FF, CR, space.
        let dropped = matches!(
            c,
            b'_' | b'-' | b'.' | b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r'
        );
        t[b] = if dropped { 0 } else { c.to_ascii_lowercase() };
        b += 1;
    }
    t
};

/// False only when the default scrubber's rules cannot change `text`
/// (see the module docs); true when they may.
pub(crate) fn may_hold_secret(text: &str) -> bool {
    if SHAPES.is_match(text.as_bytes()) || url_password_possible(text) {
        return true;
    }
    let bytes = text.as_bytes();
    if bytes.len() <= STACK_SKELETON && text.is_ascii() {
        // The common short argument: its skeleton on the stack.
        let mut buf = [0u8; STACK_SKELETON];
        let mut n = 0;
        for &b in bytes {
            let m = ASCII_SKELETON[usize::from(b & 0x7f)];
            // `n` < `bytes.len()` <= the buffer's length: the mask only
            // spares the bounds check.
            buf[n & (STACK_SKELETON - 1)] = m;
            n += usize::from(m != 0);
        }
        if KEYS.is_match(&buf[..n]) {
            return true;
        }
        if !bytes.contains(&b'\\') {
            return false;
        }
        let mut skeleton = Vec::with_capacity(text.len());
        skeleton_of(text, true, &mut skeleton);
        return KEYS.is_match(&skeleton);
    }
    let mut skeleton = Vec::with_capacity(text.len());
    skeleton_of(text, false, &mut skeleton);
    if KEYS.is_match(&skeleton) {
        return true;
    }
    if text.contains('\\') {
        skeleton.clear();
        skeleton_of(text, true, &mut skeleton);
        return KEYS.is_match(&skeleton);
    }
    false
}

/// Texts up to this long have their ASCII skeleton built on the stack (a
/// power of two).
const STACK_SKELETON: usize = 512;

/// Writes the skeleton of ASCII `bytes` to the front of `out` (at least as
/// long) and returns its length; without a branch per byte: every byte's
/// mapping is written, and the end advances only past kept ones.
fn ascii_skeleton(bytes: &[u8], out: &mut [u8]) -> usize {
    let mut n = 0;
    for &b in bytes {
        let m = ASCII_SKELETON[usize::from(b & 0x7f)];
        if let Some(slot) = out.get_mut(n) {
            *slot = m;
        }
        n += usize::from(m != 0);
    }
    n.min(out.len())
}

/// A password in a URL needs `scheme:/` (`:\/` in JSON) and an `@`.
fn url_password_possible(text: &str) -> bool {
    text.contains('@') && (text.contains(":/") || text.contains(":\\/"))
}

/// Appends `text` mapped one character at a time as a key is normalized;
/// with `json_escapes`, a backslash escape counts as the character it
/// stands for (`\u` never gets here: it is a shape piece).
fn skeleton_of(text: &str, json_escapes: bool, out: &mut Vec<u8>) {
    let bytes = text.as_bytes();
    if text.is_ascii() && !(json_escapes && bytes.contains(&b'\\')) {
        let start = out.len();
        out.resize(start + bytes.len(), 0);
        let n = ascii_skeleton(bytes, &mut out[start..]);
        out.truncate(start + n);
        return;
    }
    let mut at = 0;
    while at < bytes.len() {
        let b = bytes[at];
        if b < 0x80 && !(json_escapes && b == b'\\') {
            let m = ASCII_SKELETON[b as usize];
            if m != 0 {
                out.push(m);
            }
            at += 1;
            continue;
        }
        // A backslash escape (JSON reading) or a non-ASCII character: the
        // slow way, one `char` at a time.
        let mut chars = text[at..].chars();
        let Some(first) = chars.next() else { break };
        let c = if first == '\\' {
            match chars.next() {
                Some('t') => '\t',
                Some('n') => '\n',
                Some('r') => '\r',
                Some('f') => '\u{c}',
                Some('b') => '\u{8}',
                Some(other) => other,
                None => break,
            }
        } else {
            first
        };
        at = bytes.len() - chars.as_str().len();
        if c.is_ascii() {
            let m = ASCII_SKELETON[c as usize];
            if m != 0 {
                out.push(m);
            }
        } else if !c.is_whitespace() {
            let mut buf = [0u8; 4];
            for l in c.to_lowercase() {
                out.extend_from_slice(l.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scrub::Scrubber;
    use proptest::prelude::*;
    use serde_json::Value;

    /// What the full rules do to a text they find nothing in: nothing.
    fn untouched(text: &str) -> String {
        text.to_owned()
    }

    /// The full rules, without the prefilter: a scrubber with a pattern of
    /// its own (one that never matches) is not the default one, so it runs
    /// every rule on every text.
    fn full(text: &str) -> String {
        static FULL: LazyLock<Scrubber> = LazyLock::new(|| {
            Scrubber::new()
                .with_pattern(r"\b\B")
                .expect("a pattern that never matches")
        });
        FULL.scrub_arguments(text)
    }

    /// The contract: where the prefilter says no, the full rules find
    /// nothing to redact.
    fn check(text: &str) -> std::result::Result<(), TestCaseError> {
        if !may_hold_secret(text) {
            prop_assert_eq!(
                full(text),
                untouched(text),
                "the prefilter passed {:?} as clean",
                text
            );
        }
        Ok(())
    }

    #[test]
    fn every_secret_word_is_caught_as_key_pair_and_flag() {
        // Every word the full rules redact under as a key: the scrubber's
        // own lists, so a word added there is checked here too.
        let words = crate::scrub::SECRET_KEY_SUFFIXES
            .iter()
            .chain(crate::scrub::SECRET_KEY_EXACT);
        for w in words {
            // Spelled the way keys are: mixed case and separators.
            let spelled: String = w
                .chars()
                .enumerate()
                .map(|(i, c)| {
                    if i % 2 == 0 {
                        c.to_ascii_uppercase().to_string()
                    } else {
                        format!("{c}_")
                    }
                })
                .collect();
            for text in [
                format!(r#"{{"{spelled}":"x1"}}"#),
                format!("{spelled}=x1"),
                format!("--{spelled} x1"),
            ] {
                assert_ne!(full(&text), untouched(&text), "{text:?}");
                assert!(may_hold_secret(&text), "missed {text:?}");
            }
        }
    }

    #[test]
    fn ascii_table_is_the_key_rule() {
        for b in 0u8..128 {
            let c = b as char;
            let dropped = matches!(c, '_' | '-' | '.') || c.is_whitespace();
            let want = if dropped {
                0
            } else {
                c.to_ascii_lowercase() as u8
            };
            assert_eq!(ASCII_SKELETON[b as usize], want, "{c:?}");
        }
    }

    #[test]
    fn bench_record_is_clean() {
        let args = r#"{"query":"quarterly revenue by region for the last four quarters","max_results":25,"filters":{"region":["emea","apac","amer"],"currency":"EUR"},"include_sources":true,"note":"benchmark record of realistic size"}"#;
        assert!(!may_hold_secret(args));
        assert!(!may_hold_secret("weather in Paris"));
        assert!(!may_hold_secret(r#"{"url":"https://example.com/a"}"#));
    }

    #[test]
    fn escapes_and_unicode_are_caught() {
        for text in [
            r#"{"p\u0061ssword":"x"}"#,
            r#"{"pass\tword":"hunter2"}"#,
            r#"{"k":"https:\/\/u:p@host"}"#,
            "{\"\u{212a}ey\":1,\"api\u{212a}ey\":\"x\"}",
            "PASS\u{a0}WORD=x",
            r#"{"t\u006fken":"x"}"#,
        ] {
            assert!(may_hold_secret(text), "{text:?}");
        }
    }

    /// `(?i)bearer` matches only ASCII spellings of the word: no other
    /// character case-folds to one of its letters, so the skeleton's ASCII
    /// lower-casing sees every spelling the regex does.
    #[test]
    fn bearer_letters_fold_only_from_ascii() {
        let re = regex::Regex::new("(?i)^[bear]$").unwrap();
        for c in (0..=0x10_FFFF).filter_map(char::from_u32) {
            if re.is_match(c.encode_utf8(&mut [0; 4])) {
                assert!(c.is_ascii(), "{c:?} folds to a letter of bearer");
            }
        }
    }

    /// Pieces texts are made of: secret material, look-alikes, JSON
    /// syntax, escapes and separators.
    fn piece() -> impl Strategy<Value = String> {
        let fixed: Vec<&'static str> = vec![
            "sk-",
            "sk_live_",
            "rk_test_",
            "whsec_",
            "ghp_",
            "github_pat_",
            "xoxb-",
            "xapp-1-",
            "AKIA",
            "ASIA",
            "eyJ",
            "AIza",
            "-----BEGIN ",
            "PRIVATE KEY-----",
            "Bearer ",
            "bearer\t",
            "://",
            ":\\/\\/",
            "u:p@",
            "@",
            "pass",
            "word",
            "Pass",
            "_",
            "-",
            ".",
            " ",
            "\t",
            "\\t",
            "\\n",
            "\\\"",
            "\\u0041",
            "\"",
            ":",
            "=",
            "{",
            "}",
            "[",
            "]",
            ",",
            "token",
            "tok",
            "en",
            "api",
            "key",
            "Key",
            "auth",
            "cred",
            "cookie",
            "jwt",
            "pw",
            "d",
            "secret",
            "max",
            "s",
            "0123456789",
            "abcdefghijABCDEFGHIJ",
            "ZZZZ",
            "é",
            "\u{212a}",
            "[REDACTED]",
            "1.5",
            "-0.0",
            "1e300",
            "null",
            "true",
        ];
        // Whole secrets of every shape, so a shape the prefilter forgot
        // shows up.
        let whole: Vec<String> = vec![
            format!("sk-{}", "a1".repeat(12)),
            format!("sk_live_{}", "a1".repeat(6)),
            format!("whsec_{}", "a1".repeat(12)),
            format!("ghp_{}", "a1".repeat(18)),
            format!("github_pat_{}", "a1".repeat(18)),
            format!("xoxb-{}", "a1".repeat(6)),
            format!("xapp-1-{}", "a1".repeat(6)),
            format!("AKIA{}", "A1".repeat(8)),
            format!("ASIA{}", "A1".repeat(8)),
            "eyJhbGciOi.eyJzdWIi.c2ln".to_owned(),
            format!("AIza{}", "a1".repeat(18)),
            "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----".to_owned(),
            "Bearer abc123def".to_owned(),
            "https://bob:hunter2@example.com/".to_owned(),
        ];
        prop_oneof![
            2 => prop::sample::select(whole),
            3 => prop::sample::select(fixed).prop_map(str::to_owned),
            1 => "[a-zA-Z0-9]{1,24}",
            1 => any::<char>().prop_map(String::from),
        ]
    }

    fn text() -> impl Strategy<Value = String> {
        prop::collection::vec(piece(), 0..24).prop_map(|p| p.concat())
    }

    /// JSON built from generated pieces: as keys, as values, nested.
    fn json() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            text().prop_map(Value::String),
            any::<i64>().prop_map(Value::from),
            any::<bool>().prop_map(Value::Bool),
        ];
        let value = leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec((text(), inner), 0..4)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        });
        (value, any::<bool>()).prop_map(|(v, pretty)| {
            if pretty {
                serde_json::to_string_pretty(&v).expect("serializes")
            } else {
                v.to_string()
            }
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Plain text: wherever the prefilter says clean, the rules agree.
        #[test]
        fn prop_clean_text_is_left_alone_by_the_rules(t in text()) {
            check(&t)?;
        }

        /// JSON, secrets in values and in keys: the same.
        #[test]
        fn prop_clean_json_is_left_alone_by_the_rules(t in json()) {
            check(&t)?;
        }
    }
}
