//! The scrubber's prefilter: one cheap pass that tells when the default
//! rules cannot change a tool call's arguments, so the common clean argument
//! skips the JSON parse and the rule regexes.
//!
//! [`may_hold_secret`] is conservative: it answers `true` for every text the
//! full rules could redact anything in, and may answer `true` for others.
//! It looks for what every rule needs to see, in two forms of the text:
//!
//! - the raw text, for the secret shapes: each shape's match holds a fixed
//!   piece (`sk-`, `ghp_`, `xox`, `AKIA`, `eyJ`, `-----BEGIN`, …, and for a
//!   URL password `:/` — `:\/` in JSON — with an `@` after it) that JSON
//!   can only spell differently with a `\u` escape — and any `\u` escape
//!   makes the answer `true`;
//! - the text's *skeleton*: every character mapped as the key rule
//!   normalizes a key (lower-cased; `_`, `-`, `.` and whitespace dropped),
//!   once as written and once with JSON's escapes read (`\t` is whitespace
//!   there). A key or a `key=value` pair that names a secret normalizes to
//!   something ending with a secret word, and the mapping is one character
//!   at a time, so that word is a substring of the skeleton; the word list
//!   here holds a piece of every secret word (`pass`, `pw`, `secret`,
//!   `token`, `auth`, `cred`, `cookie`, `apikey`, …).
//!
//! Both are one pass over the text's bytes: two automata (Aho-Corasick,
//! built once into 256-state byte tables) step side by side, the second
//! reading each byte as the skeleton maps it. Only a text with a backslash
//! or a non-ASCII character has its skeletons built and searched apart
//! (escapes and Unicode case need more than one byte at a time).
//!
//! A text that holds none of these reaches the rules unchanged: the
//! property test below runs generated texts (JSON and not, secrets as
//! values, as keys and as words) through both and checks it.

use std::sync::LazyLock;

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

/// A multi-substring automaton's transition table over bytes, with its
/// states numbered so that one `u8` names each: row `s` holds the next
/// state after each byte. [`MATCH`] (and [`UNSURE`], where used) are
/// absorbing: once reached, every byte keeps the state there, so a scan
/// need not stop to look until its end.
struct Table {
    rows: Box<[[u8; 256]; 256]>,
}

/// The start state of every table.
const ROOT: u8 = 0;
/// A piece occurred (absorbing).
const MATCH: u8 = 1;
/// The key table met a byte it cannot map alone (a backslash, or a byte of
/// a non-ASCII character): the skeletons must be built (absorbing).
const UNSURE: u8 = 2;
/// The first state number left for the automaton's own states.
const FIRST_FREE: usize = 3;

/// An Aho-Corasick automaton over bytes, as a full transition function:
/// `next[node][byte]`, and for each node the kinds (bit set) of the pieces
/// that end there, its failure chain included.
struct Trie {
    next: Vec<[u16; 256]>,
    ends: Vec<u8>,
}

impl Trie {
    /// `pieces` with their kind bits.
    #[allow(clippy::expect_used, reason = "prefilter automaton fits u16")]
    fn new(pieces: &[(&[u8], u8)]) -> Trie {
        const NONE: u16 = u16::MAX;
        let mut next = vec![[NONE; 256]];
        let mut ends = vec![0u8];
        for &(piece, kind) in pieces {
            let mut at = 0usize;
            for &b in piece {
                if next[at][usize::from(b)] == NONE {
                    next.push([NONE; 256]);
                    ends.push(0);
                    next[at][usize::from(b)] =
                        u16::try_from(next.len() - 1).expect("prefilter automaton fits u16");
                }
                at = usize::from(next[at][usize::from(b)]);
            }
            ends[at] |= kind;
        }
        // Breadth first: a node's failure target is shallower, so it is
        // complete (transitions filled, ends merged) before the node.
        let mut fail = vec![0u16; next.len()];
        let mut queue = std::collections::VecDeque::new();
        for slot in &mut next[0] {
            match *slot {
                NONE => *slot = 0,
                child => {
                    fail[usize::from(child)] = 0;
                    queue.push_back(child);
                }
            }
        }
        while let Some(node) = queue.pop_front() {
            let node = usize::from(node);
            let f = usize::from(fail[node]);
            ends[node] |= ends[f];
            let via_fail = next[f];
            for (slot, &target) in next[node].iter_mut().zip(&via_fail) {
                match *slot {
                    NONE => *slot = target,
                    child => {
                        fail[usize::from(child)] = target;
                        queue.push_back(child);
                    }
                }
            }
        }
        Trie { next, ends }
    }
}

/// Numbers the states a table reaches from its root (state 0 of `space`
/// automaton states), in the order they are found; `step(state, byte)`
/// gives either a fixed state (`Err`) or an automaton state to number
/// (`Ok`).
#[allow(
    clippy::expect_used,
    reason = "numbered before queued; prefilter automaton fits 256 states"
)]
fn number(space: usize, step: impl Fn(usize, u8) -> Result<usize, u8>) -> Table {
    let mut rows = Box::new([[ROOT; 256]; 256]);
    for fixed in [MATCH, UNSURE] {
        rows[usize::from(fixed)] = [fixed; 256];
    }
    let mut ids: Vec<Option<u8>> = vec![None; space];
    ids[0] = Some(ROOT);
    let mut next_id = FIRST_FREE;
    let mut todo = vec![0];
    while let Some(s) = todo.pop() {
        let id = ids[s].expect("numbered before queued");
        for b in 0..=255u8 {
            let target = match step(s, b) {
                Err(fixed) => fixed,
                Ok(t) => *ids[t].get_or_insert_with(|| {
                    todo.push(t);
                    next_id += 1;
                    u8::try_from(next_id - 1).expect("prefilter automaton fits 256 states")
                }),
            };
            rows[usize::from(id)][usize::from(b)] = target;
        }
    }
    Table { rows }
}

impl Table {
    /// The state after `bytes`, from the root.
    fn run(&self, bytes: &[u8]) -> u8 {
        bytes
            .iter()
            .fold(ROOT, |s, &b| self.rows[usize::from(s)][usize::from(b)])
    }
}

/// A shape piece (the match is the answer).
const SHAPE: u8 = 1;
/// `:/` or `:\/`: from here on, an `@` makes a URL password possible.
const URL_SCHEME: u8 = 2;

/// The three tables the prefilter runs.
struct Tables {
    /// Over the raw text: the shape pieces, and a URL scheme followed by
    /// an `@` (a URL password's `scheme://user:password@` holds both, in
    /// that order).
    raw: Table,
    /// Over the raw text, read as its skeleton: the key pieces. A byte the
    /// skeleton drops keeps the state; a backslash or a non-ASCII byte goes
    /// to [`UNSURE`].
    key: Table,
    /// Over a built skeleton: the key pieces.
    skeleton: Table,
}

static TABLES: LazyLock<Tables> = LazyLock::new(|| {
    let mut raw_pieces: Vec<(&[u8], u8)> =
        SHAPE_PIECES.iter().map(|p| (p.as_bytes(), SHAPE)).collect();
    raw_pieces.extend([(&b":/"[..], URL_SCHEME), (&b":\\/"[..], URL_SCHEME)]);
    let raw = Trie::new(&raw_pieces);
    // A raw state is a trie node and whether a URL scheme came before:
    // `node * 2 + armed`.
    let raw = number(raw.next.len() * 2, |state, b| {
        let (node, armed) = (state / 2, state % 2 == 1);
        let to = usize::from(raw.next[node][usize::from(b)]);
        let ends = raw.ends[to];
        if ends & SHAPE != 0 || (armed && b == b'@') {
            return Err(MATCH);
        }
        Ok(to * 2 + usize::from(armed || ends & URL_SCHEME != 0))
    });
    let key_pieces: Vec<(&[u8], u8)> = KEY_PIECES.iter().map(|p| (p.as_bytes(), SHAPE)).collect();
    let keys = Trie::new(&key_pieces);
    let key_step = |node: usize, b: u8| {
        let to = usize::from(keys.next[node][usize::from(b)]);
        if keys.ends[to] != 0 {
            Err(MATCH)
        } else {
            Ok(to)
        }
    };
    let key = number(keys.next.len(), |node, b| {
        if b >= 0x80 || b == b'\\' {
            return Err(UNSURE);
        }
        match ASCII_SKELETON[usize::from(b)] {
            0 => Ok(node),
            m => key_step(node, m),
        }
    });
    let skeleton = number(keys.next.len(), key_step);
    Tables { raw, key, skeleton }
});

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
pub fn may_hold_secret(text: &str) -> bool {
    let t = &*TABLES;
    // One pass, both automata: the shapes over the raw bytes, the key
    // pieces over the skeleton the same bytes spell.
    let (mut raw, mut key) = (ROOT, ROOT);
    let mut step = |b: u8| {
        raw = t.raw.rows[usize::from(raw)][usize::from(b)];
        key = t.key.rows[usize::from(key)][usize::from(b)];
    };
    // Four bytes a turn: the loop's own count and branch once per four.
    let bytes = text.as_bytes();
    let mut quads = bytes.chunks_exact(4);
    for q in &mut quads {
        step(q[0]);
        step(q[1]);
        step(q[2]);
        step(q[3]);
    }
    for &b in quads.remainder() {
        step(b);
    }
    if raw == MATCH || key == MATCH {
        return true;
    }
    if key != UNSURE {
        return false;
    }
    // A backslash or a non-ASCII character: the skeleton as written, then
    // with JSON's escapes read.
    let mut skeleton = Vec::with_capacity(text.len());
    skeleton_of(text, false, &mut skeleton);
    if t.skeleton.run(&skeleton) == MATCH {
        return true;
    }
    if text.contains('\\') {
        skeleton.clear();
        skeleton_of(text, true, &mut skeleton);
        return t.skeleton.run(&skeleton) == MATCH;
    }
    false
}

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

    /// The tables' answer is the plain definition's: a shape piece in the
    /// raw text, `:/` or `:\/` before an `@`, or a key piece in either
    /// skeleton.
    fn by_definition(text: &str) -> bool {
        let has = |hay: &[u8], pieces: &[&str]| {
            pieces
                .iter()
                .any(|p| hay.windows(p.len()).any(|w| w == p.as_bytes()))
        };
        let url = text.find('@').is_some_and(|_| {
            [":/", ":\\/"].iter().any(|scheme| {
                text.find(scheme)
                    .is_some_and(|at| text[at + scheme.len()..].contains('@'))
            })
        });
        let mut written = Vec::new();
        skeleton_of(text, false, &mut written);
        let mut escaped = Vec::new();
        skeleton_of(text, true, &mut escaped);
        has(text.as_bytes(), SHAPE_PIECES)
            || url
            || has(&written, KEY_PIECES)
            || has(&escaped, KEY_PIECES)
    }

    #[test]
    fn tables_fit_and_agree_with_the_definition() {
        let t = &*TABLES;
        for text in [
            "",
            "a@b.c https://x.com/",
            "https://u:p@host",
            "https:\\/\\/u:p@host",
            "@https://",
            "xx sk-",
            "s k-",
            "PaSs",
            "p_a-s.s",
            "pa\\tss",
            "\\token",
            "to\\u006ben",
            "caf\u{e9} token",
            "caf\u{e9}",
        ] {
            assert_eq!(may_hold_secret(text), by_definition(text), "{text:?}");
        }
        assert_eq!(t.raw.run(b"ghp_"), MATCH);
        assert_eq!(t.key.run("é".as_bytes()), UNSURE);
        assert_eq!(t.skeleton.run(b"cookie"), MATCH);
    }

    #[test]
    fn url_password_needs_the_scheme_before_the_at() {
        for text in [
            r#"{"email":"bob@example.com","site":"https://example.com/a"}"#,
            "mail bob@example.com about http://x",
        ] {
            assert!(!may_hold_secret(text), "{text:?}");
            assert_eq!(full(text), untouched(text), "{text:?}");
        }
        assert!(may_hold_secret(r#"{"db":"postgres:\/\/u:pw1@h"}"#));
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

        /// The one-pass tables answer what the definition says, for every
        /// text.
        #[test]
        fn prop_tables_are_the_definition(t in text()) {
            prop_assert_eq!(may_hold_secret(&t), by_definition(&t), "{:?}", t);
        }
    }
}
