//! The scrubber's JSON path: one walk over the text that copies what it
//! does not change byte for byte and rewrites only the redacted strings,
//! keys and values (rules X2–X3).
//!
//! The walk accepts exactly the texts `serde_json` parses into a `Value`
//! (RFC 8259, at most 127 nested arrays and objects, numbers that fit an
//! `f64`, escapes that decode, no raw control character in a string), so
//! the JSON path and the plain-text path split the inputs where they did
//! when the scrubber parsed a `Value`: strings with escapes are decoded by
//! `serde_json` itself, and every number is checked by it.
//!
//! What it writes equals, as JSON (parsed back into a `Value`), what the
//! `Value` walk wrote: every string value and key is scrubbed as text, the
//! value under a secret key becomes `"[REDACTED]"`, and a key that changes
//! is renamed after the keys that do not, numbered (` #2`, ` #3`, …) in
//! the order of the original names. An object with a key given twice is
//! read, like `serde_json` reads it, as holding the last one; so every
//! spelling of a renamed key gets the same new name, and the output read
//! back holds the same entries.

use std::borrow::Cow;
use std::collections::HashSet;
use std::ops::Range;

use super::{REDACTED, Scrubber};

/// `serde_json`'s recursion limit: the 128th nested container is refused.
const MAX_DEPTH: u32 = 127;

/// `"[REDACTED]"`, as the JSON string that replaces a secret key's value.
const REDACTED_JSON: &str = "\"[REDACTED]\"";

/// Scrubs `text` as JSON: `None` when it is not JSON; the text itself
/// (borrowed) when nothing in it changes.
pub(super) fn scrub<'t>(scrubber: &Scrubber, text: &'t str) -> Option<Cow<'t, str>> {
    let mut walk = Walk {
        scrubber,
        prefilter: scrubber.is_default(),
        text,
        bytes: text.as_bytes(),
        pos: 0,
        out: String::new(),
        copied: 0,
        edited: false,
        depth: 0,
        names: Vec::new(),
        renames: Vec::new(),
    };
    walk.skip_ws();
    walk.value(true)?;
    walk.skip_ws();
    if walk.pos != text.len() {
        return None;
    }
    Some(walk.finish())
}

/// A key that scrubbing changed, waiting for its object to end: only then
/// are all the names it must not collide with known.
struct Rename<'t> {
    /// The key as decoded from the text.
    original: Cow<'t, str>,
    /// The key scrubbed.
    clean: String,
    /// Where its new name goes in the output.
    at: usize,
    /// The unique name, once chosen.
    name: String,
}

struct Walk<'a, 't> {
    scrubber: &'a Scrubber,
    /// The default rules: the prefilter can clear a string before them.
    prefilter: bool,
    text: &'t str,
    bytes: &'t [u8],
    /// The next byte to read.
    pos: usize,
    /// The output for `text[..copied]`, once something changed.
    out: String,
    copied: usize,
    edited: bool,
    /// Containers open around `pos`.
    depth: u32,
    /// The unchanged keys of the objects open, innermost last.
    names: Vec<Cow<'t, str>>,
    /// The renamed keys of the objects open, innermost last.
    renames: Vec<Rename<'t>>,
}

impl<'t> Walk<'_, 't> {
    fn finish(mut self) -> Cow<'t, str> {
        if !self.edited {
            return Cow::Borrowed(self.text);
        }
        self.out.push_str(&self.text[self.copied..]);
        Cow::Owned(self.out)
    }

    /// Copies the text up to `upto` to the output, and marks the output
    /// edited.
    fn flush(&mut self, upto: usize) {
        if !self.edited {
            self.edited = true;
            self.out.reserve(self.text.len() + REDACTED.len());
        }
        self.out.push_str(&self.text[self.copied..upto]);
        self.copied = upto;
    }

    /// Writes `with` in place of `range` of the text.
    fn replace(&mut self, range: Range<usize>, with: &str) {
        self.flush(range.start);
        self.out.push_str(with);
        self.copied = range.end;
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    /// One value at `pos`; `scrub` false only checks it (the value under a
    /// secret key, replaced whole).
    fn value(&mut self, scrub: bool) -> Option<()> {
        match self.peek()? {
            b'{' => self.object(scrub),
            b'[' => self.array(scrub),
            b'"' => {
                let (range, decoded) = self.string()?;
                if scrub && let Some(clean) = self.scrubbed(&decoded) {
                    self.replace(range, &quoted(&clean));
                }
                Some(())
            }
            b't' => self.literal("true"),
            b'f' => self.literal("false"),
            b'n' => self.literal("null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn literal(&mut self, word: &str) -> Option<()> {
        self.text[self.pos..].starts_with(word).then(|| {
            self.pos += word.len();
        })
    }

    /// A number as `serde_json` reads it: the run of number characters,
    /// checked by `serde_json` (grammar, and an `f64` that does not
    /// overflow). A character of that set after a number is an error in
    /// every place a value can end, so the run is the whole token.
    fn number(&mut self) -> Option<()> {
        let start = self.pos;
        while let Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') = self.peek() {
            self.pos += 1;
        }
        serde_json::from_str::<f64>(&self.text[start..self.pos])
            .is_ok()
            .then_some(())
    }

    /// The string at `pos` (a `"`): its range, quotes included, and its
    /// text; a string with escapes is decoded by `serde_json`.
    fn string(&mut self) -> Option<(Range<usize>, Cow<'t, str>)> {
        let start = self.pos;
        let mut at = start + 1;
        let mut escaped = false;
        loop {
            match *self.bytes.get(at)? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    // The escaped byte may start a multi-byte char; the
                    // scan stops only at ASCII bytes, so every range it
                    // returns is on char boundaries.
                    at += 2;
                }
                0..0x20 => return None,
                _ => at += 1,
            }
        }
        let end = at + 1;
        self.pos = end;
        let text: &'t str = self.text;
        let decoded = if escaped {
            Cow::Owned(serde_json::from_str::<String>(&text[start..end]).ok()?)
        } else {
            Cow::Borrowed(&text[start + 1..at])
        };
        Some((start..end, decoded))
    }

    fn enter(&mut self) -> Option<()> {
        self.depth += 1;
        self.pos += 1;
        (self.depth <= MAX_DEPTH).then_some(())
    }

    fn array(&mut self, scrub: bool) -> Option<()> {
        self.enter()?;
        self.skip_ws();
        if self.peek()? == b']' {
            self.pos += 1;
            self.depth -= 1;
            return Some(());
        }
        loop {
            self.value(scrub)?;
            self.skip_ws();
            match self.peek()? {
                b',' => {
                    self.pos += 1;
                    self.skip_ws();
                }
                b']' => break,
                _ => return None,
            }
        }
        self.pos += 1;
        self.depth -= 1;
        Some(())
    }

    fn object(&mut self, scrub: bool) -> Option<()> {
        self.enter()?;
        let (names_from, renames_from) = (self.names.len(), self.renames.len());
        self.skip_ws();
        if self.peek()? != b'}' {
            loop {
                if self.peek()? != b'"' {
                    return None;
                }
                let (key_range, key) = self.string()?;
                self.skip_ws();
                if self.peek()? != b':' {
                    return None;
                }
                self.pos += 1;
                self.skip_ws();
                if scrub {
                    self.member(key_range, key)?;
                } else {
                    self.value(false)?;
                }
                self.skip_ws();
                match self.peek()? {
                    b',' => {
                        self.pos += 1;
                        self.skip_ws();
                    }
                    b'}' => break,
                    _ => return None,
                }
            }
        }
        self.pos += 1;
        self.depth -= 1;
        if self.renames.len() > renames_from {
            self.name_renamed(names_from, renames_from);
        }
        self.names.truncate(names_from);
        self.renames.truncate(renames_from);
        Some(())
    }

    /// One entry of an object being scrubbed; `pos` is at its value.
    fn member(&mut self, key_range: Range<usize>, key: Cow<'t, str>) -> Option<()> {
        let clean = self.scrubbed(&key);
        // Redacted whole when the old or the new name is a secret key, so
        // the second pass, which sees only the new name, decides the same.
        let secret = self.is_secret_key(&key)
            || clean
                .as_deref()
                .is_some_and(|c| self.scrubber.is_secret_key(c));
        match clean {
            None => self.names.push(key),
            Some(clean) => {
                self.flush(key_range.start);
                self.copied = key_range.end;
                self.renames.push(Rename {
                    original: key,
                    clean,
                    at: self.out.len(),
                    name: String::new(),
                });
            }
        }
        let start = self.pos;
        if secret {
            self.value(false)?;
            if &self.text[start..self.pos] != REDACTED_JSON {
                self.replace(start..self.pos, REDACTED_JSON);
            }
        } else {
            self.value(true)?;
        }
        Some(())
    }

    /// Names the renamed keys of the object that just ended (its unchanged
    /// keys are `names[names_from..]`) and writes the names in.
    fn name_renamed(&mut self, names_from: usize, renames_from: usize) {
        let mut taken: HashSet<String> = self.names[names_from..]
            .iter()
            .map(|name| name.as_ref().to_owned())
            .collect();
        let renames = &mut self.renames[renames_from..];
        // In the order of the original names; a name given twice keeps its
        // order in the text (the sort is stable) and gets one new name.
        renames.sort_by(|a, b| a.original.cmp(&b.original));
        let mut i = 0;
        while i < renames.len() {
            let clean = &renames[i].clean;
            let mut name = clean.clone();
            let mut n = 2u64;
            while taken.contains(&name) {
                name = format!("{clean} #{n}");
                n += 1;
            }
            let mut j = i;
            while j < renames.len() && renames[j].original == renames[i].original {
                renames[j].name.clone_from(&name);
                j += 1;
            }
            taken.insert(name);
            i = j;
        }
        // Last first, so the earlier positions still hold.
        renames.sort_by_key(|r| std::cmp::Reverse(r.at));
        for rename in renames.iter() {
            self.out.insert_str(rename.at, &quoted(&rename.name));
        }
    }

    /// `text` scrubbed, `None` when it does not change.
    fn scrubbed(&self, text: &str) -> Option<String> {
        if self.prefilter && !crate::scrub_prefilter::may_hold_secret(text) {
            return None;
        }
        self.scrubber.fixed_point(text, true)
    }

    fn is_secret_key(&self, key: &str) -> bool {
        if self.prefilter && !crate::scrub_prefilter::may_hold_secret(key) {
            return false;
        }
        self.scrubber.is_secret_key(key)
    }
}

/// `text` as a JSON string: quoted, with `"`, `\` and the control
/// characters escaped as `serde_json` escapes them.
fn quoted(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                let b = c as usize;
                out.push_str("\\u00");
                out.push(char::from(HEX[b >> 4]));
                out.push(char::from(HEX[b & 0xf]));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::super::{REDACTED, Scrubber};
    use proptest::prelude::*;
    use serde_json::Value;

    /// The scrubber's JSON path before this walk: parse a `Value`, scrub
    /// every string and key, write it back. The walk is held to it.
    mod reference {
        use super::super::super::{REDACTED, Scrubber};
        use serde_json::Value;

        pub(super) fn scrub_arguments(s: &Scrubber, text: &str) -> String {
            if let Some(json) = json(s, text) {
                return json;
            }
            let plain = s.fixed_point(text, true).unwrap_or_else(|| text.to_owned());
            json(s, &plain).unwrap_or(plain)
        }

        fn json(s: &Scrubber, text: &str) -> Option<String> {
            let mut value: Value = serde_json::from_str(text).ok()?;
            scrub_value(s, &mut value);
            Some(value.to_string())
        }

        fn scrub_value(s: &Scrubber, value: &mut Value) {
            match value {
                Value::Object(map) => {
                    let mut renamed = Vec::new();
                    for (key, item) in std::mem::take(map) {
                        match s.fixed_point(&key, true) {
                            None => {
                                let item = scrubbed_item(s, &key, None, item);
                                map.insert(key, item);
                            }
                            Some(clean) => renamed.push((clean, key, item)),
                        }
                    }
                    for (clean, key, item) in renamed {
                        let item = scrubbed_item(s, &key, Some(&clean), item);
                        let mut name = clean.clone();
                        let mut n = 2u64;
                        while map.contains_key(&name) {
                            name = format!("{clean} #{n}");
                            n += 1;
                        }
                        map.insert(name, item);
                    }
                }
                Value::Array(items) => items.iter_mut().for_each(|item| scrub_value(s, item)),
                Value::String(text) => {
                    if let Some(clean) = s.fixed_point(text, true) {
                        *text = clean;
                    }
                }
                Value::Number(_) | Value::Bool(_) | Value::Null => {}
            }
        }

        fn scrubbed_item(s: &Scrubber, key: &str, clean: Option<&str>, mut item: Value) -> Value {
            if s.is_secret_key(key) || clean.is_some_and(|c| s.is_secret_key(c)) {
                return Value::String(REDACTED.to_owned());
            }
            scrub_value(s, &mut item);
            item
        }
    }

    /// The walk's output and the reference's are the same JSON (the same
    /// text when neither is JSON); the walk's is idempotent, and it is the
    /// input itself when nothing was redacted (which the reference shows
    /// only when no object gives a key twice: it drops all but the last).
    fn agree(s: &Scrubber, text: &str) -> Result<(), TestCaseError> {
        agree_on(s, text, false)
    }

    fn agree_on(s: &Scrubber, text: &str, unique_keys: bool) -> Result<(), TestCaseError> {
        let new = s.scrub_arguments(text);
        let old = reference::scrub_arguments(s, text);
        match (
            serde_json::from_str::<Value>(&new),
            serde_json::from_str::<Value>(&old),
        ) {
            (Ok(a), Ok(b)) => prop_assert_eq!(a, b, "input {:?}: {:?} vs {:?}", text, new, old),
            (Err(_), Err(_)) => prop_assert_eq!(&new, &old, "input {:?}", text),
            _ => prop_assert!(
                false,
                "input {:?}: one JSON, one not: {:?} vs {:?}",
                text,
                new,
                old
            ),
        }
        prop_assert_eq!(
            s.scrub_arguments(&new),
            new.clone(),
            "not idempotent on {:?}",
            text
        );
        // When the input already holds the marker, the reference's output
        // cannot show whether a secret key's value was replaced (by an equal
        // one, written differently), so there the text may change.
        let as_read = serde_json::from_str::<Value>(text).map(|v| v.to_string());
        if unique_keys
            && as_read
                .as_deref()
                .is_ok_and(|t| t == old && !t.contains(REDACTED))
        {
            prop_assert_eq!(&new, text, "nothing redacted, yet the text changed");
        }
        Ok(())
    }

    fn scrubbers() -> [Scrubber; 2] {
        [
            Scrubber::new(),
            Scrubber::new()
                .with_secret_key("ssn")
                .with_pattern(r"\bID-[0-9]{4}\b")
                .expect("valid pattern"),
        ]
    }

    /// JSON as a tree whose objects may give a key twice.
    #[derive(Debug, Clone)]
    enum J {
        Null,
        Bool(bool),
        Int(i64),
        Float(f64),
        Str(String),
        Arr(Vec<J>),
        Obj(Vec<(String, J)>),
    }

    fn unique_keys(j: &J) -> bool {
        match j {
            J::Arr(items) => items.iter().all(unique_keys),
            J::Obj(members) => {
                let names: std::collections::HashSet<&str> =
                    members.iter().map(|(k, _)| k.as_str()).collect();
                names.len() == members.len() && members.iter().all(|(_, v)| unique_keys(v))
            }
            _ => true,
        }
    }

    /// How a tree is written: whitespace after each token, and how strings
    /// are escaped (0: as `serde_json` does; 1: every ASCII punctuation and
    /// `/` escaped; 2: everything outside ASCII as `\u` surrogates).
    #[derive(Debug, Clone)]
    struct Style {
        ws: &'static str,
        escape: u8,
    }

    fn write_str(text: &str, style: &Style, out: &mut String) {
        if style.escape == 0 {
            out.push_str(&Value::from(text).to_string());
            return;
        }
        out.push('"');
        for c in text.chars() {
            match c {
                '/' if style.escape == 1 => out.push_str("\\/"),
                c if c.is_ascii_punctuation() && style.escape == 1 => {
                    out.push_str(&format!("\\u{:04X}", u32::from(c)));
                }
                c if !c.is_ascii() && style.escape == 2 => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push_str(Value::from(c.to_string()).to_string().trim_matches('"')),
            }
        }
        out.push('"');
    }

    fn write(j: &J, style: &Style, out: &mut String) {
        match j {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Int(i) => out.push_str(&i.to_string()),
            J::Float(f) => out.push_str(&Value::from(*f).to_string()),
            J::Str(s) => write_str(s, style, out),
            J::Arr(items) => {
                out.push('[');
                out.push_str(style.ws);
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                        out.push_str(style.ws);
                    }
                    write(item, style, out);
                }
                out.push_str(style.ws);
                out.push(']');
            }
            J::Obj(members) => {
                out.push('{');
                out.push_str(style.ws);
                for (i, (key, item)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                        out.push_str(style.ws);
                    }
                    write_str(key, style, out);
                    out.push_str(style.ws);
                    out.push(':');
                    out.push_str(style.ws);
                    write(item, style, out);
                }
                out.push_str(style.ws);
                out.push('}');
            }
        }
    }

    /// Pieces of strings and keys: plain words, secret keys and counts,
    /// every kind of secret, redacted markers, and characters JSON escapes.
    const PIECES: &[&str] = &[
        "a",
        "city",
        "Paris",
        "password",
        "api_key",
        "Token",
        "max_tokens",
        "auth",
        "ssn",
        "ID-1234",
        REDACTED,
        "[REDACTED] #2",
        " #3",
        " ",
        "=",
        ": ",
        "--token ",
        "\"",
        "\\",
        "/",
        "\n",
        "\u{1}",
        "é",
        "😀",
        "ghp_aB3dE5fG7hJ9kL2mN4pQ6rS8tU1vW0xYzaB3d",
        "sk-aB3dE5fG7hJ9kL2mN4pQ6rS8tU1vW0xYz",
        "AKIAIOSFODNN7EXAMPLE",
        "Bearer abc123def456",
        "password=hunter2",
        "postgres://u:pw@db/x",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln",
        "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----",
        "xoxb-1234567890-abc",
    ];

    fn text() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(PIECES), 0..4).prop_map(|v| v.concat())
    }

    fn tree() -> impl Strategy<Value = J> {
        let leaf = prop_oneof![
            Just(J::Null),
            any::<bool>().prop_map(J::Bool),
            any::<i64>().prop_map(J::Int),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(J::Float),
            text().prop_map(J::Str),
        ];
        leaf.prop_recursive(4, 40, 5, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(J::Arr),
                prop::collection::vec((text(), inner), 0..5).prop_map(J::Obj),
            ]
        })
    }

    fn style() -> impl Strategy<Value = Style> {
        (
            prop::sample::select(&["", " ", "\n  ", "\t", "\r\n"][..]),
            0u8..3,
        )
            .prop_map(|(ws, escape)| Style { ws, escape })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(600))]

        #[test]
        fn the_walk_agrees_with_the_value_path_on_json(j in tree(), style in style()) {
            let mut text = String::new();
            write(&j, &style, &mut text);
            for s in scrubbers() {
                agree_on(&s, &text, unique_keys(&j))?;
            }
        }

        #[test]
        fn the_walk_agrees_with_the_value_path_on_text(
            pieces in prop::collection::vec(
                prop_oneof![
                    prop::sample::select(PIECES),
                    prop::sample::select(&[
                        "{", "}", "[", "]", ",", ":", "\"", "1", "-0", "1e400", "2.5e-3",
                        "01", "1.", "true", "nul", "\\u00e9", "\\ud800", "\\uD83D\\uDE00",
                        "\\x", "\u{FEFF}", "\t", "\u{0}", "{\"password\":", "\"k\":",
                    ][..]),
                ],
                0..12,
            )
        ) {
            let text = pieces.concat();
            for s in scrubbers() {
                agree(&s, &text)?;
            }
        }
    }

    #[test]
    fn json_edges_split_like_serde_json() {
        let deep = |n: usize, inner: &str| format!("{}{inner}{}", "[".repeat(n), "]".repeat(n));
        let mut cases = vec![
            deep(127, r#"{"password":1}"#),
            deep(126, r#"{"password":1}"#),
            deep(127, "1"),
            deep(128, "1"),
            deep(127, r#""sk-aB3dE5fG7hJ9kL2mN4pQ6rS8tU1vW0xYz""#),
        ];
        for bad_or_odd in [
            r#"{"password":1e400}"#,
            r#"{"password":1e-400}"#,
            r#"{"password":-0}"#,
            r#"{"password":123456789012345678901234567890}"#,
            r#"{"password":01}"#,
            r#"{"password":1.}"#,
            r#"{"password":"\ud800"}"#,
            r#"{"password":"\uD83D\uDE00"}"#,
            "{\"password\":\"a\u{1}b\"}",
            r#"{"password":"a"}x"#,
            r#"{"password":"a",}"#,
            r#"[1,]"#,
            " \t\r\n{\"token\" : \"x\" } \n",
            "\u{FEFF}{\"token\":\"x\"}",
            r#"{"token":tru}"#,
            r#"{"a":{"token":[1,{"b":2}]},"token":{"c":"sk-aB3dE5fG7hJ9kL2mN4pQ6rS8tU1vW0xYz"}}"#,
            "",
            " ",
        ] {
            cases.push(bad_or_odd.to_owned());
        }
        for s in scrubbers() {
            for case in &cases {
                agree(&s, case).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }

    #[test]
    fn a_secret_value_that_spells_the_marker_with_escapes_becomes_the_marker() {
        // Found by CI's proptest run: the value is replaced (by an equal
        // one), so the text may change; the result must still agree.
        let s = Scrubber::new();
        let args = r#"{"apassword":"\u005BREDACTED\u005D"}"#;
        assert_eq!(s.scrub_arguments(args), r#"{"apassword":"[REDACTED]"}"#);
        agree_on(&s, args, true).unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn layout_and_order_are_kept_around_what_is_redacted() {
        let s = Scrubber::new();
        let args = "{\n  \"z\": [1, 2.50, 1E3],\n  \"password\": {\"x\": 1},\n  \"a\": \"\\u0041 ghp_aB3dE5fG7hJ9kL2mN4pQ6rS8tU1vW0xYzaB3d\"\n}";
        assert_eq!(
            s.scrub_arguments(args),
            "{\n  \"z\": [1, 2.50, 1E3],\n  \"password\": \"[REDACTED]\",\n  \"a\": \"A [REDACTED]\"\n}"
        );
    }

    #[test]
    fn a_key_given_twice_reads_back_as_serde_json_reads_it() {
        let s = Scrubber::new();
        let gh = "ghp_aB3dE5fG7hJ9kL2mN4pQ6rS8tU1vW0xYzaB3d";
        let args = format!(r#"{{"{gh}":1,"[REDACTED]":0,"{gh}":2,"b":3,"b":4}}"#);
        let out = s.scrub_arguments(&args);
        assert_eq!(
            out,
            r#"{"[REDACTED] #2":1,"[REDACTED]":0,"[REDACTED] #2":2,"b":3,"b":4}"#
        );
        agree(&s, &args).unwrap_or_else(|e| panic!("{e}"));
        // Renamed keys are numbered in the order of their original names,
        // wherever they stand in the text.
        let out = s.scrub_arguments(
            r#"{"sk-bbbbbbbbbbbbbbbbbbbbbbbb":1,"sk-aaaaaaaaaaaaaaaaaaaaaaaa":2}"#,
        );
        assert_eq!(out, r#"{"[REDACTED] #2":1,"[REDACTED]":2}"#);
    }
}
