//! Secret scrubbing of tool-call arguments (rules X1–X4).
//!
//! Every write stores [`RunRecord::scrubbed`](crate::RunRecord::scrubbed): the
//! `arguments` of each pending tool call pass through
//! [`Scrubber::scrub_arguments`] first, and each secret found is replaced by
//! [`REDACTED`] (`"[REDACTED]"`).
//!
//! # Secret keys (X2)
//!
//! When the arguments are valid JSON, the value under every object key that
//! names a secret, at any depth, becomes the string `"[REDACTED]"`, whatever
//! its JSON type (string, number, bool, null, object or array).
//!
//! A key names a secret when its *normalized* form (lower-cased, with `_`,
//! `-`, `.` and whitespace removed: `X-Api-Key` → `xapikey`)
//!
//! - ends with (or equals) one of `password`, `passwords`, `passwd`, `pwd`,
//!   `passphrase`, `passcode`, `passwordconfirmation`, `passwordconfirm`,
//!   `secret`, `secrets`, `token`, `apikey`, `apikeys`, `authorization`,
//!   `credential`, `credentials`, `creds`, `privatekey`, `privkey`,
//!   `secretkey`, `accesskey`, `accesskeyid`, `signingkey`, `encryptionkey`,
//!   `masterkey`, `cookie`, `cookies`, `bearer` or `jwt`
//!   (so `apiKey`, `API_KEY`, `x-api-key`, `client_secret`, `refresh_token`,
//!   `Authorization`, `session_cookie`, `set-cookie`, `privateKey`,
//!   `aws_secret_access_key` are all secret keys);
//! - or equals `auth`, `pass` or `pw` (only whole: `bypass` and `oauth_flow`
//!   are not secret keys);
//! - or ends with a name added by [`Scrubber::with_secret_key`].
//!
//! Counts are not secrets. A key ending with `tokens`, `count`, `used`, …
//! never matches the list above (`max_tokens`, `tokens_used`,
//! `token_count`), and a key whose secret word is `token` is treated as a
//! count, and kept, when it contains `max` or starts with `num` or `total`
//! (`max_token`, `num_token`, `total_token`).
//!
//! # Secret-shaped strings (X3)
//!
//! Inside every JSON string value and every object key, and in arguments
//! that are not JSON, these shapes are replaced, and only them: surrounding
//! text stays.
//!
//! An object key is scrubbed like a string value: `{"sk_live_…": 1}` becomes
//! `{"[REDACTED]": 1}`. So that no entry is lost, a scrubbed key that
//! would equal another key of its object gets ` #2`, ` #3`, … appended
//! (keys that did not change keep their names; renamed keys are numbered
//! in the order of their original names). The value under such a key is
//! scrubbed as usual (redacted whole when the old or the new name is a
//! secret key).
//!
//! | shape | example of what is replaced |
//! |---|---|
//! | PEM private-key block, multi-line; an unterminated one to the end of the text | `-----BEGIN RSA PRIVATE KEY-----` … `-----END RSA PRIVATE KEY-----` |
//! | bearer token (`Bearer` is kept) whose token holds a digit or is 24+ chars | `Bearer <token>` → `Bearer [REDACTED]` |
//! | `OpenAI` / `Anthropic` key | `sk-…`, `sk-proj-…`, `sk-ant-…` (20+ chars after `sk-`) |
//! | Stripe secret / restricted key, webhook secret | `sk_live_…`, `rk_live_…`, `sk_test_…`, `rk_test_…`, `whsec_…` |
//! | GitHub token | `ghp_`, `gho_`, `ghu_`, `ghs_`, `ghr_`, `github_pat_` + 30+ chars |
//! | Slack token | `xoxb-`, `xoxp-`, `xoxa-`, `xoxr-`, `xoxs-`, `xapp-` + 10+ chars |
//! | AWS access key id | `AKIA` / `ASIA` + 16 upper-case letters or digits |
//! | JWT (and 5-part JWE) | `eyJ…` `.` `…` `.` `…` |
//! | Google API key | `AIza` + 35 chars |
//! | password in a URL (the password only) | `postgres://user:[REDACTED]@host/db` |
//! | extra patterns | added by [`Scrubber::with_pattern`] |
//!
//! Plain text, whether the whole arguments (when they are not valid JSON) or
//! a JSON string value, is also scrubbed of `key=value`, `key: value`,
//! `key := value`, `key => value` and `--key value` pairs whose key names a
//! secret by the rule above (`password=hunter2` → `password=[REDACTED]`,
//! `"api_key": "abc"` → `"api_key": "[REDACTED]"`, `--token abc` →
//! `--token [REDACTED]`). The value is a quoted string (its inside is
//! replaced, the quotes stay), or an optional HTTP auth scheme (`Basic`,
//! `Bearer`, …) and the run of characters up to whitespace or one of
//! `` "'`,;&|)]}<>\ ``. Values starting with `[`, `{`, `(`, `=` or `:` are
//! taken for structure and left alone, and so is a `--key` followed by
//! `-…` (another flag).
//!
//! [`Scrubber::scrub_text`] applies the shapes only, without the pairs.
//!
//! # Idempotence (X4)
//!
//! `scrub(scrub(x)) == scrub(x)` for every input, and scrubbing never panics:
//!
//! - Text is scrubbed to a fixed point (each rule is applied until nothing
//!   changes). A match that overlaps a `[REDACTED]` already in the text is
//!   left alone, so every change strictly shrinks the unredacted text and the
//!   loop ends; no built-in shape matches `[REDACTED]`, and
//!   [`Scrubber::with_pattern`] refuses patterns that do.
//! - Arguments in which no rule can find anything come back exactly as
//!   given, JSON layout included: a one-pass prefilter
//!   (`src/scrub_prefilter.rs`) rejects them before any parsing.
//! - Other valid JSON is walked once (`src/scrub/json.rs`): what does not
//!   change is copied byte for byte (layout, key order, escapes and the
//!   spelling of every number), and only a string, key or value that is
//!   redacted is written anew (as JSON, escaped the way `serde_json`
//!   writes strings). The second pass finds every rewritten piece at its
//!   fixed point and copies it. An object that gives a key twice is read
//!   the way `serde_json` reads it, as holding the last one: both
//!   spellings of a renamed key get the same new name.
//! - Text that is not JSON (malformed, or nested deeper than `serde_json`'s
//!   recursion limit of 128) is scrubbed as plain text. If redaction turned
//!   it into valid JSON (say a PEM block holding a raw control character
//!   was removed), the result is then scrubbed as JSON, which is what the
//!   second pass would do.

mod json;

use std::borrow::Cow;
use std::ops::Range;
use std::sync::{Arc, LazyLock};

use regex::Regex;

use crate::error::StateError;
use crate::record::RunRecord;

/// The text every redacted secret is replaced with.
pub const REDACTED: &str = "[REDACTED]";

/// Normalized key endings that name a secret (see the module docs).
pub const SECRET_KEY_SUFFIXES: &[&str] = &[
    "password",
    "passwords",
    "passwd",
    "pwd",
    "passphrase",
    "passcode",
    "passwordconfirmation",
    "passwordconfirm",
    "secret",
    "secrets",
    "token",
    "apikey",
    "apikeys",
    "authorization",
    "credential",
    "credentials",
    "creds",
    "privatekey",
    "privkey",
    "secretkey",
    "accesskey",
    "accesskeyid",
    "signingkey",
    "encryptionkey",
    "masterkey",
    "cookie",
    "cookies",
    "bearer",
    "jwt",
];

/// Normalized keys that name a secret only when they are the whole key:
/// as endings they would catch `bypass`, `compass`, `oauth`.
pub const SECRET_KEY_EXACT: &[&str] = &["auth", "pass", "pw"];

/// HTTP auth schemes that may precede the value of a `key: value` pair
/// (`Authorization: Basic dXNlcjpwYXNz`); the scheme is redacted with it.
const AUTH_SCHEMES: &[&str] = &[
    "basic",
    "bearer",
    "bot",
    "digest",
    "negotiate",
    "ntlm",
    "token",
];

/// A built-in secret shape.
struct Shape {
    pattern: &'static str,
    /// The capture group holding the secret; 0 for the whole match.
    group: usize,
    /// A check on the secret's text, for shapes a regex alone over-matches.
    accept: fn(&str) -> bool,
}

fn always(_: &str) -> bool {
    true
}

/// A bearer "token" that is an English word (`Bearer authentication`) is not
/// a token: real ones hold a digit or are long.
fn token_like(token: &str) -> bool {
    token.len() >= 24 || token.bytes().any(|b| b.is_ascii_digit())
}

const SHAPES: &[Shape] = &[
    Shape {
        // PEM private-key block; an unterminated one (a truncated key) is
        // redacted to the end.
        pattern: r"(?s)-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----(?:.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|.*)",
        group: 0,
        accept: always,
    },
    Shape {
        // Bearer token. `[` is not a token character, so
        // `Bearer [REDACTED]` never matches.
        pattern: r"(?i)\bbearer[ \t]+([A-Za-z0-9\-._~+/]+=*)",
        group: 1,
        accept: token_like,
    },
    Shape {
        // OpenAI / Anthropic key (`sk-proj-…`, `sk-ant-…` included).
        pattern: r"\bsk-[A-Za-z0-9_\-]{20,}",
        group: 0,
        accept: always,
    },
    Shape {
        // Stripe secret / restricted key, webhook secret.
        pattern: r"\b(?:(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{10,}|whsec_[A-Za-z0-9+/=]{20,})",
        group: 0,
        accept: always,
    },
    Shape {
        // GitHub token.
        pattern: r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})",
        group: 0,
        accept: always,
    },
    Shape {
        // Slack token.
        pattern: r"\b(?:xox[abprs]-[A-Za-z0-9\-]{10,}|xapp-[0-9]-[A-Za-z0-9\-]{10,})",
        group: 0,
        accept: always,
    },
    Shape {
        // AWS access key id.
        pattern: r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b",
        group: 0,
        accept: always,
    },
    Shape {
        // JWT, and the 5-part JWE.
        pattern: r"\beyJ[A-Za-z0-9_\-]{6,}\.[A-Za-z0-9_\-]*\.[A-Za-z0-9_\-]*(?:\.[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]+)?",
        group: 0,
        accept: always,
    },
    Shape {
        // Google API key.
        pattern: r"\bAIza[A-Za-z0-9_\-]{35,}",
        group: 0,
        accept: always,
    },
    Shape {
        // Password in a URL. The password group can be `[REDACTED]` on a
        // second pass; the overlap rule leaves it alone then.
        pattern: r#"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#@"'<>\[\]]*:([^\s/?#@"'<>]+)@"#,
        group: 1,
        accept: always,
    },
];

/// One compiled secret shape, built in or added by the user.
#[derive(Debug, Clone)]
struct Rule {
    regex: Regex,
    group: usize,
    accept: fn(&str) -> bool,
}

#[allow(clippy::expect_used, reason = "built-in scrub pattern compiles")]
static DEFAULT_RULES: LazyLock<Arc<[Rule]>> = LazyLock::new(|| {
    SHAPES
        .iter()
        .map(|shape| Rule {
            regex: Regex::new(shape.pattern).expect("built-in scrub pattern compiles"),
            group: shape.group,
            accept: shape.accept,
        })
        .collect()
});

/// `key=value`, `key: value`, `"key": "value"`, `key := value`,
/// `key => value`; also the `\"key\": \"value\"` of JSON escaped in text.
/// Only the key and separator are matched: the value is read by
/// [`value_span`], so a non-secret pair does not swallow what follows it.
#[allow(clippy::expect_used, reason = "built-in pair pattern compiles")]
static PAIR: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?P<key>[A-Za-z0-9_][A-Za-z0-9_.\-]*)(?:\\?["'])?[ \t]*(?::=|=>|=|:)[ \t]*"#)
        .expect("built-in pair pattern compiles")
});

/// `--key value` command-line flags.
#[allow(clippy::expect_used, reason = "built-in flag pattern compiles")]
static FLAG: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?:^|[\s"'])--(?P<key>[A-Za-z][A-Za-z0-9_.\-]*)[ \t]+"#)
        .expect("built-in flag pattern compiles")
});

/// Removes secrets from tool-call arguments, replacing each with
/// [`REDACTED`].
///
/// - In JSON arguments, the whole value under a key that names a secret:
///   its normalized form (lower-cased, `_ - .` and whitespace removed) ends
///   with `password`, `passwd`, `pwd`, `secret`, `token`, `apikey`,
///   `authorization`, `credential(s)`, `privatekey`, `accesskey`, `cookie`,
///   … or is `auth`, `pass` or `pw`. Token counts are kept: `max_tokens`,
///   `tokens_used`, `token_count`, `max_token`.
/// - In JSON string values and in non-JSON arguments, secret-shaped
///   substrings: PEM private keys, bearer tokens, `sk-…` (`OpenAI`,
///   `Anthropic`), Stripe, GitHub, Slack and Google API keys, AWS access key
///   ids, JWTs, URL passwords, and your own patterns; plus the values of
///   `key=value`, `key: value` and `--key value` pairs whose key names a
///   secret.
/// - Scrubbing is idempotent and never panics. Arguments with nothing to
///   redact come back exactly as given; in other valid JSON only what is
///   redacted is rewritten, the rest (layout, key order, numbers) stays as
///   given.
///
/// `Scrubber::default()` is cheap: the built-in rules are compiled once per
/// process and shared, and clones share everything through `Arc`s.
///
/// ```
/// use agentstate::Scrubber;
///
/// let scrubber = Scrubber::new();
/// let args = r#"{"api_key":"abc123","query":"weather in Paris"}"#;
/// assert_eq!(
///     scrubber.scrub_arguments(args),
///     r#"{"api_key":"[REDACTED]","query":"weather in Paris"}"#,
/// );
/// assert_eq!(
///     scrubber.scrub_arguments("curl -H 'Authorization: Bearer abc.def.123' --password=hunter2"),
///     "curl -H 'Authorization: [REDACTED]' --password=[REDACTED]",
/// );
///
/// // Your own rules come on top of the built-in ones.
/// let scrubber = Scrubber::new()
///     .with_secret_key("ssn")
///     .with_pattern(r"\bACME-[0-9]{8}\b")?;
/// assert_eq!(
///     scrubber.scrub_arguments(r#"{"note":"ticket ACME-12345678","ssn":"078-05-1120"}"#),
///     r#"{"note":"ticket [REDACTED]","ssn":"[REDACTED]"}"#,
/// );
/// # Ok::<(), agentstate::StateError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Scrubber {
    /// Built-in shapes, then the user's patterns, applied in this order;
    /// `None` is the built-in shapes alone, compiled at the first scrub
    /// rather than when the scrubber (or a store's `Options`) is made, so
    /// opening a store does not wait for regexes it may never run.
    rules: Option<Arc<[Rule]>>,
    /// User-added secret key names, normalized.
    secret_keys: Arc<[String]>,
}

impl Default for Scrubber {
    /// The built-in rules only.
    fn default() -> Self {
        Scrubber {
            rules: None,
            secret_keys: Arc::default(),
        }
    }
}

impl Scrubber {
    /// A scrubber with the built-in rules only (same as `default()`).
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a key name that names a secret. It is normalized like every key
    /// (lower-cased; `_`, `-`, `.` and whitespace removed) and matches keys
    /// that end with it, in JSON objects and in `key=value` pairs. A name
    /// that normalizes to nothing is ignored (it would match every key).
    #[must_use]
    pub fn with_secret_key(mut self, name: &str) -> Self {
        let name = normalize_key(name);
        if !name.is_empty() {
            let mut keys = self.secret_keys.to_vec();
            keys.push(name);
            self.secret_keys = keys.into();
        }
        self
    }

    /// Adds a secret-shaped pattern (regex crate syntax). Each match is
    /// replaced by [`REDACTED`]; when the pattern has a capture group named
    /// `secret`, only that group is replaced
    /// (`token=(?P<secret>\w+)` → `token=[REDACTED]`).
    ///
    /// # Errors
    ///
    /// [`StateError::Invalid`] when the pattern does not compile, or when it
    /// matches `[REDACTED]` itself (anywhere in it, the empty match
    /// included): such a pattern would redact its own output.
    pub fn with_pattern(mut self, pattern: &str) -> Result<Self, StateError> {
        let regex = Regex::new(pattern)
            .map_err(|e| StateError::invalid(format!("scrub pattern {pattern:?}: {e}")))?;
        if regex.is_match(REDACTED) {
            return Err(StateError::invalid(format!(
                "scrub pattern {pattern:?} matches {REDACTED:?}, so scrubbing would not be idempotent"
            )));
        }
        let group = regex
            .capture_names()
            .position(|name| name == Some("secret"))
            .unwrap_or(0);
        let mut rules = self.rules().to_vec();
        rules.push(Rule {
            regex,
            group,
            accept: always,
        });
        self.rules = Some(rules.into());
        Ok(self)
    }

    /// Scrubs tool-call arguments: as JSON when `text` is valid JSON (only
    /// the redacted strings, keys and values are rewritten; the rest is
    /// copied as given), as plain text otherwise. Idempotent; never panics.
    #[must_use]
    pub fn scrub_arguments(&self, text: &str) -> String {
        self.scrubbed_arguments(text).into_owned()
    }

    /// [`scrub_arguments`](Self::scrub_arguments), borrowing `text` when
    /// nothing in it changes.
    fn scrubbed_arguments<'t>(&self, text: &'t str) -> Cow<'t, str> {
        if self.is_default() && !crate::scrub_prefilter::may_hold_secret(text) {
            return Cow::Borrowed(text);
        }
        if let Some(json) = json::scrub(self, text) {
            return json;
        }
        let Some(plain) = self.fixed_point(text, true) else {
            return Cow::Borrowed(text);
        };
        // Redaction can turn malformed JSON into valid JSON; the next pass
        // would then take the JSON path, so take it now.
        match json::scrub(self, &plain) {
            Some(Cow::Owned(json)) => Cow::Owned(json),
            _ => Cow::Owned(plain),
        }
    }

    /// Replaces the secret-shaped substrings of a plain string (the shapes
    /// and the user's patterns only: no key rules, no `key=value` pairs).
    /// Idempotent; never panics.
    #[must_use]
    pub fn scrub_text(&self, text: &str) -> String {
        self.fixed_point(text, false)
            .unwrap_or_else(|| text.to_owned())
    }

    /// A clone of `record` with the arguments of every pending tool call
    /// scrubbed by [`scrub_arguments`](Self::scrub_arguments).
    #[must_use]
    pub fn scrub_run(&self, record: &RunRecord) -> RunRecord {
        self.scrub_run_owned(record.clone())
    }

    /// `record` with the arguments of every pending tool call scrubbed, in
    /// place: for a caller that owns the record, no clone of it, and no
    /// allocation at all when nothing is redacted.
    #[must_use]
    pub fn scrub_run_owned(&self, mut record: RunRecord) -> RunRecord {
        self.scrub_run_in_place(&mut record);
        record
    }

    /// [`scrub_run_owned`](Self::scrub_run_owned) where the record is.
    pub fn scrub_run_in_place(&self, record: &mut RunRecord) {
        for call in &mut record.pending_tool_calls {
            if let Cow::Owned(clean) = self.scrubbed_arguments(&call.arguments) {
                call.arguments = clean;
            }
        }
        if let Some(clean) = crate::labels::scrubbed(self, &record.labels) {
            record.labels = clean;
        }
    }

    /// A session's labels scrubbed, in place (rule R11).
    pub fn scrub_session_in_place(&self, record: &mut crate::record::SessionRecord) {
        if let Some(clean) = crate::labels::scrubbed(self, &record.labels) {
            record.labels = clean;
        }
    }

    /// True when [`scrub_arguments`](Self::scrub_arguments) would return
    /// `text` unchanged.
    #[must_use]
    pub fn is_clean(&self, text: &str) -> bool {
        self.scrubbed_arguments(text) == text
    }

    /// Applies passes (shapes, and pairs first when `with_pairs`) until one
    /// changes nothing; `None` when the first one changes nothing. Ends:
    /// every change replaces a non-empty stretch of text outside any
    /// `[REDACTED]` with `[REDACTED]`, so the text outside them shrinks at
    /// each pass.
    fn fixed_point(&self, text: &str, with_pairs: bool) -> Option<String> {
        let mut current = self.pass(text, with_pairs)?;
        while let Some(next) = self.pass(&current, with_pairs) {
            current = next;
        }
        Some(current)
    }

    /// One pass of every rule, in order; `None` when nothing changed.
    fn pass(&self, text: &str, with_pairs: bool) -> Option<String> {
        let mut changed: Option<String> = None;
        let mut step = |ranges_of: &dyn Fn(&str) -> Vec<Range<usize>>| {
            let current = changed.as_deref().unwrap_or(text);
            let ranges = ranges_of(current);
            if !ranges.is_empty() {
                changed = Some(redact_ranges(current, &ranges));
            }
        };
        if with_pairs {
            // Pairs first: `Authorization: Bearer x` is redacted whole,
            // scheme included, rather than as `Bearer [REDACTED]`.
            step(&|t| self.pair_ranges(&PAIR, t, true));
            step(&|t| self.pair_ranges(&FLAG, t, false));
        }
        for rule in self.rules() {
            step(&|t| rule_ranges(rule, t));
        }
        changed
    }

    /// The values of the secret pairs `pair` finds in `text`.
    fn pair_ranges(&self, pair: &Regex, text: &str, dash_value_ok: bool) -> Vec<Range<usize>> {
        let redacted = RedactedSpans::of(text);
        let mut ranges = Vec::new();
        let mut pos = 0;
        while let Some(caps) = pair.captures_at(text, pos) {
            let (Some(whole), Some(key)) = (caps.get(0), caps.name("key")) else {
                break;
            };
            // Resume right after the key, not the whole match: the next key
            // may start inside what a non-secret pair's value would span.
            pos = key.end();
            if !self.is_secret_key(key.as_str()) {
                continue;
            }
            if !dash_value_ok && text[whole.end()..].starts_with('-') {
                continue;
            }
            if let Some((range, resume)) = value_span(text, whole.end()) {
                pos = resume;
                if !redacted.overlaps(&range) {
                    ranges.push(range);
                }
            }
        }
        ranges
    }

    /// The built-in rules only: the prefilter knows them.
    fn is_default(&self) -> bool {
        self.rules.is_none() && self.secret_keys.is_empty()
    }

    /// The rules applied in order (the built-in ones compile on first use).
    fn rules(&self) -> &[Rule] {
        match &self.rules {
            Some(rules) => rules,
            None => &DEFAULT_RULES,
        }
    }

    /// Whether a key names a secret (the rule in the module docs).
    fn is_secret_key(&self, key: &str) -> bool {
        let key = normalize_key(key);
        if SECRET_KEY_EXACT.contains(&key.as_str())
            || self
                .secret_keys
                .iter()
                .any(|name| key.ends_with(name.as_str()))
        {
            return true;
        }
        SECRET_KEY_SUFFIXES
            .iter()
            .any(|word| key.ends_with(word) && !(*word == "token" && is_token_count(&key)))
    }
}

/// Lower-cased, without `_`, `-`, `.` and whitespace.
fn normalize_key(key: &str) -> String {
    key.chars()
        .filter(|c| !matches!(c, '_' | '-' | '.') && !c.is_whitespace())
        .flat_map(char::to_lowercase)
        .collect()
}

/// `max_token`, `num_token`, `total_token`: a number of tokens, not a token.
fn is_token_count(normalized: &str) -> bool {
    normalized.contains("max") || normalized.starts_with("num") || normalized.starts_with("total")
}

/// The secrets a shape finds in `text`, skipping empty ones, rejected ones
/// and those overlapping a `[REDACTED]`.
fn rule_ranges(rule: &Rule, text: &str) -> Vec<Range<usize>> {
    let redacted = RedactedSpans::of(text);
    let keep = |m: regex::Match<'_>| {
        let range = m.range();
        (!range.is_empty() && !redacted.overlaps(&range) && (rule.accept)(m.as_str()))
            .then_some(range)
    };
    if rule.group == 0 {
        rule.regex.find_iter(text).filter_map(keep).collect()
    } else {
        rule.regex
            .captures_iter(text)
            .filter_map(|caps| caps.get(rule.group))
            .filter_map(keep)
            .collect()
    }
}

/// `text` with each range (sorted, disjoint) replaced by [`REDACTED`].
fn redact_ranges(text: &str, ranges: &[Range<usize>]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut last = 0;
    for range in ranges {
        out.push_str(&text[last..range.start]);
        out.push_str(REDACTED);
        last = range.end;
    }
    out.push_str(&text[last..]);
    out
}

/// Where `[REDACTED]` already occurs in a text, in order.
struct RedactedSpans(Vec<Range<usize>>);

impl RedactedSpans {
    fn of(text: &str) -> Self {
        RedactedSpans(
            text.match_indices(REDACTED)
                .map(|(at, _)| at..at + REDACTED.len())
                .collect(),
        )
    }

    fn overlaps(&self, range: &Range<usize>) -> bool {
        let first_after = self.0.partition_point(|span| span.end <= range.start);
        self.0
            .get(first_after)
            .is_some_and(|span| span.start < range.end)
    }
}

/// Ends a bare (unquoted) value.
fn ends_bare(b: u8) -> bool {
    b.is_ascii_whitespace()
        || matches!(
            b,
            b'"' | b'\''
                | b'`'
                | b','
                | b';'
                | b'&'
                | b'|'
                | b')'
                | b']'
                | b'}'
                | b'<'
                | b'>'
                | b'\\'
        )
}

/// Can start a bare value; `[ { (` open structure, `= :` continue an
/// operator (`==`, `::`).
fn starts_bare(b: u8) -> bool {
    !ends_bare(b) && !matches!(b, b'[' | b'{' | b'(' | b'=' | b':')
}

/// The value that starts at byte `start` of `text`: the range to redact and
/// where scanning resumes. `None` when there is no value to redact. Every
/// position returned is at an ASCII byte or the end, so on a char boundary.
fn value_span(text: &str, start: usize) -> Option<(Range<usize>, usize)> {
    let bytes = text.as_bytes();
    let rest = bytes.get(start..)?;
    let line_end = |from: usize| {
        bytes[from..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(bytes.len(), |at| from + at)
    };
    let (range, resume) = match rest {
        // `\"value\"`: JSON escaped inside text.
        [b'\\', b'"', ..] => {
            let from = start + 2;
            match text[from..].find("\\\"") {
                Some(at) => (from..from + at, from + at + 2),
                None => (from..line_end(from), line_end(from)),
            }
        }
        [quote @ (b'"' | b'\''), ..] => {
            let from = start + 1;
            let mut at = from;
            while at < bytes.len() && bytes[at] != *quote && bytes[at] != b'\n' {
                // A backslash escapes the next byte in double quotes; the
                // next byte may start a multi-byte char, but the scan only
                // ever stops at ASCII bytes.
                at += if *quote == b'"' && bytes[at] == b'\\' {
                    2
                } else {
                    1
                };
            }
            let end = at.min(bytes.len());
            let resume = if bytes.get(end) == Some(quote) {
                end + 1
            } else {
                end
            };
            (from..end, resume)
        }
        [first, ..] if starts_bare(*first) => {
            let bare_end = |from: usize| {
                bytes[from..]
                    .iter()
                    .position(|&b| ends_bare(b))
                    .map_or(bytes.len(), |at| from + at)
            };
            let word_end = start + rest.iter().take_while(|b| b.is_ascii_alphabetic()).count();
            let word = &text[start..word_end];
            let mut end = bare_end(start);
            if AUTH_SCHEMES.iter().any(|s| word.eq_ignore_ascii_case(s)) {
                let gap = bytes[word_end..]
                    .iter()
                    .take_while(|&&b| b == b' ' || b == b'\t')
                    .count();
                let credential = word_end + gap;
                match bytes.get(credential) {
                    Some(&b) if gap > 0 && starts_bare(b) => end = bare_end(credential),
                    // `Bearer [REDACTED]`, `Basic (…`: not a value to redact.
                    Some(&b) if gap > 0 && b != b'\n' && b != b'\r' => return None,
                    _ => {}
                }
            }
            (start..end, end)
        }
        _ => return None,
    };
    (!range.is_empty()).then_some((range, resume))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{RunKey, ToolCall};
    use serde_json::Value;

    /// Scrubs `input` as arguments, checks idempotence of both public
    /// entry points on it and on the output, and returns the output.
    fn scrub_with(scrubber: &Scrubber, input: &str) -> String {
        let once = scrubber.scrub_arguments(input);
        assert_eq!(
            scrubber.scrub_arguments(&once),
            once,
            "scrub_arguments not idempotent on {input:?}"
        );
        assert!(scrubber.is_clean(&once), "output not clean: {once:?}");
        let text = scrubber.scrub_text(input);
        assert_eq!(
            scrubber.scrub_text(&text),
            text,
            "scrub_text not idempotent on {input:?}"
        );
        once
    }

    fn scrub(input: &str) -> String {
        scrub_with(&Scrubber::new(), input)
    }

    fn scrub_json(input: &str) -> Value {
        let out = scrub(input);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?} is not JSON: {e}"))
    }

    fn text(input: &str) -> String {
        let out = Scrubber::new().scrub_text(input);
        assert_eq!(Scrubber::new().scrub_text(&out), out);
        out
    }

    /// Deterministic fake secret material: `n` letters and digits.
    fn fake(n: usize) -> String {
        const CHARS: &[u8] = b"aB3dE5fG7hJ9kL2mN4pQ6rS8tU1vW0xYz";
        (0..n)
            .map(|i| CHARS[(i * 7 + 3) % CHARS.len()] as char)
            .collect()
    }

    fn pem(kind: &str) -> String {
        let body = format!("{}\n{}\n{}==", fake(64), fake(64), fake(30));
        format!("-----BEGIN {kind}PRIVATE KEY-----\n{body}\n-----END {kind}PRIVATE KEY-----")
    }

    /// One fake of every built-in secret shape.
    fn shaped_secrets() -> Vec<String> {
        vec![
            format!("sk-{}", fake(48)),
            format!("sk-proj-{}", fake(40)),
            format!("sk-ant-api03-{}-{}", fake(80), fake(12)),
            format!("sk_live_{}", fake(24)),
            format!("rk_live_{}", fake(24)),
            format!("sk_test_{}", fake(24)),
            format!("whsec_{}", fake(32)),
            format!("ghp_{}", fake(36)),
            format!("gho_{}", fake(36)),
            format!("ghu_{}", fake(36)),
            format!("ghs_{}", fake(36)),
            format!("ghr_{}", fake(36)),
            format!("github_pat_11ABCDEFG0{}_{}", fake(22), fake(59)),
            "xoxb-1234567890-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx".to_owned(),
            "xoxp-1234567890-1234567890-1234567890123-0123456789abcdef".to_owned(),
            format!("xoxa-2-{}", fake(30)),
            format!("xoxr-{}", fake(30)),
            format!("xoxs-{}", fake(30)),
            format!("xapp-1-A0123456789-{}", fake(30)),
            "AKIAIOSFODNN7EXAMPLE".to_owned(),
            "ASIAY34FZKBOKMUTVV7A".to_owned(),
            "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c".to_owned(),
            "AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY".to_owned(),
            pem("RSA "),
            pem(""),
            pem("EC "),
            pem("OPENSSH "),
            pem("ENCRYPTED "),
        ]
    }

    #[test]
    fn secret_shaped_keys_are_redacted_and_no_entry_is_lost() {
        for secret in shaped_secrets() {
            let input = serde_json::json!({
                secret.clone(): "value",
                "city": "Paris",
                "nested": { format!("id {secret}"): {"a": 1}, "[REDACTED]": true },
                "list": [{ secret.clone(): 2, "[REDACTED]": 3, "[REDACTED] #2": 4 }],
                "api_key": { secret.clone(): "x" },
            })
            .to_string();
            let out = scrub(&input);
            assert!(!out.contains(secret.as_str()), "{secret} kept in {out}");
            let v: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v["city"], "Paris");
            // A PEM block ends in `PRIVATE KEY-----`: a secret key name too.
            let named = Scrubber::new().is_secret_key(&secret);
            let or_redacted = |v: Value| if named { Value::from(REDACTED) } else { v };
            assert_eq!(v[REDACTED], or_redacted("value".into()), "{secret}: {out}");
            if !named {
                assert_eq!(v["nested"]["id [REDACTED]"]["a"], 1, "{out}");
            }
            assert_eq!(v["nested"][REDACTED], true, "{out}");
            let list = &v["list"][0];
            assert_eq!(
                list.as_object().unwrap().len(),
                3,
                "an entry was lost: {out}"
            );
            assert_eq!(list[REDACTED], 3, "a key that stays keeps its name: {out}");
            assert_eq!(list["[REDACTED] #2"], 4, "{out}");
            assert_eq!(list["[REDACTED] #3"], or_redacted(2.into()), "{out}");
            assert_eq!(v["api_key"], REDACTED);
        }
        // Two secrets that scrub to one name: both entries stay.
        let (a, b) = (format!("ghp_{}", fake(36)), format!("sk-{}", fake(48)));
        let out = scrub_json(&serde_json::json!({ a.clone(): 1, b.clone(): 2 }).to_string());
        let mut got: Vec<i64> = out
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_i64().unwrap())
            .collect();
        got.sort();
        assert_eq!(got, [1, 2], "{out}");
        // A key that holds a key=value secret, and a renamed key that names a
        // secret key: its value is redacted too.
        let out =
            scrub_json(r#"{"password=hunter2":"x","sk_live_abcdefghijklmnopqrstuvwx token":"y"}"#);
        assert_eq!(out["password=[REDACTED]"], "x");
        assert_eq!(out["[REDACTED] token"], REDACTED);
    }

    #[test]
    fn every_shape_is_redacted_in_text_with_surroundings_kept() {
        for secret in shaped_secrets() {
            let input = format!("before {secret} after");
            assert_eq!(text(&input), "before [REDACTED] after", "{secret}");
            assert_eq!(scrub(&input), "before [REDACTED] after", "{secret}");
        }
    }

    #[test]
    fn every_shape_is_redacted_inside_json_strings() {
        for secret in shaped_secrets() {
            let args = serde_json::json!({
                "command": format!("deploy --verbose {secret} now"),
                "list": [format!("({secret})")],
            })
            .to_string();
            let out = scrub_json(&args);
            assert_eq!(
                out["command"], "deploy --verbose [REDACTED] now",
                "{secret}"
            );
            assert_eq!(out["list"][0], "([REDACTED])", "{secret}");
        }
    }

    #[test]
    fn secrets_at_the_edges_and_back_to_back() {
        let gh = format!("ghp_{}", fake(36));
        let aws = "AKIAIOSFODNN7EXAMPLE";
        assert_eq!(text(&gh), REDACTED);
        assert_eq!(text(&format!("{gh},{aws}")), "[REDACTED],[REDACTED]");
        assert_eq!(text(&format!("{aws}\n{gh}")), "[REDACTED]\n[REDACTED]");
    }

    #[test]
    fn bearer_tokens() {
        assert_eq!(
            text("Authorization: Bearer abc123def456ghi789"),
            "Authorization: Bearer [REDACTED]"
        );
        assert_eq!(text("bearer a1b2c3d4"), "bearer [REDACTED]");
        assert_eq!(text(&format!("BEARER {}==", fake(40))), "BEARER [REDACTED]");
        // With pairs, an Authorization header loses its scheme too.
        assert_eq!(
            scrub("curl -H 'Authorization: Bearer abc123def456ghi789' https://api.example.com"),
            "curl -H 'Authorization: [REDACTED]' https://api.example.com"
        );
        // Words are not tokens.
        for prose in [
            "the Bearer of bad news",
            "Bearer authentication is used",
            "Bearer <token>",
            "Bearer $TOKEN",
            "Bearer [REDACTED]",
        ] {
            assert_eq!(text(prose), prose);
        }
    }

    #[test]
    fn pem_blocks_multi_line_and_unterminated() {
        let key = pem("RSA ");
        let input = format!("key follows:\n{key}\nthanks");
        assert_eq!(text(&input), "key follows:\n[REDACTED]\nthanks");
        // Two blocks are two redactions, the text between them stays.
        let input = format!("{key}\nmiddle\n{}", pem(""));
        assert_eq!(text(&input), "[REDACTED]\nmiddle\n[REDACTED]");
        // A truncated key is redacted to the end.
        let input = format!("start -----BEGIN PRIVATE KEY-----\n{}", fake(100));
        assert_eq!(text(&input), "start [REDACTED]");
        // Public material is not a secret.
        let public = "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n-----END PUBLIC KEY-----";
        assert_eq!(text(public), public);
        // In JSON the block is inside a string, with escaped newlines.
        let args = serde_json::json!({ "content": format!("x\n{key}\ny") }).to_string();
        assert_eq!(scrub_json(&args)["content"], "x\n[REDACTED]\ny");
    }

    #[test]
    fn url_passwords() {
        assert_eq!(
            text("connect to postgres://admin:s3cr3t-P4ss@db.internal:5432/app please"),
            "connect to postgres://admin:[REDACTED]@db.internal:5432/app please"
        );
        assert_eq!(
            text("redis://:hunter2@cache:6379"),
            "redis://:[REDACTED]@cache:6379"
        );
        for clean in [
            "https://example.com:8443/path?q=1",
            "http://[::1]:8080/",
            "mailto:someone@example.com",
        ] {
            assert_eq!(text(clean), clean);
        }
    }

    #[test]
    fn look_alikes_are_left_alone() {
        for clean in [
            "pip install scikit-learn; import sklearn as sk-learn",
            "task-force-alpha-bravo-charlie-delta",
            "ghp_short",
            "xoxb-",
            "AKIA1234",
            "AKIAIOSFODNN7EXAMPLEXYZ",
            "eyJhbGciOi",
            "AIzaShort",
            "sk_live_",
            "tokenization of tokens",
            "the password is not here",
            "[REDACTED]",
            "",
        ] {
            assert_eq!(scrub(clean), clean);
            assert_eq!(text(clean), clean);
        }
    }

    #[test]
    fn secret_keys_of_every_family() {
        let keys = [
            "password",
            "Password",
            "PASSWORD",
            "db_password",
            "db.password",
            "new-password",
            "passwd",
            "pwd",
            "passphrase",
            "password_confirmation",
            "secret",
            "client_secret",
            "clientSecret",
            "secrets",
            "token",
            "access_token",
            "accessToken",
            "refresh_token",
            "id_token",
            "apiKey",
            "api_key",
            "API_KEY",
            "api-key",
            "x-api-key",
            "X-API-KEY",
            "Api Key",
            "Authorization",
            "proxy-authorization",
            "credential",
            "credentials",
            "aws_credentials",
            "private_key",
            "privateKey",
            "Private Key",
            "access_key",
            "aws_access_key_id",
            "aws_secret_access_key",
            "AWS_SECRET_ACCESS_KEY",
            "secret_key",
            "signing_key",
            "cookie",
            "session_cookie",
            "set-cookie",
            "Set-Cookie",
            "cookies",
            "auth",
            "pass",
            "pw",
            "bearer",
            "jwt",
        ];
        for key in keys {
            let args = serde_json::json!({ key: "s3cr3t-value", "other": "kept" }).to_string();
            let out = scrub_json(&args);
            assert_eq!(out[key], REDACTED, "key {key:?}");
            assert_eq!(out["other"], "kept", "key {key:?}");
        }
    }

    #[test]
    fn counts_and_other_keys_are_not_secrets() {
        let keys = [
            "max_tokens",
            "maxTokens",
            "max_completion_tokens",
            "max_output_tokens",
            "tokens_used",
            "token_count",
            "input_tokens",
            "output_tokens",
            "total_tokens",
            "tokens",
            "max_token",
            "num_token",
            "total_token",
            "token_limit",
            "token_type",
            "tokenizer",
            "password_policy",
            "password_min_length",
            "secret_santa_name",
            "author",
            "key",
            "keyboard",
            "monkey",
            "bypass",
            "compass",
            "oauth_flow",
            "session_id",
            "passenger",
            "cookie_policy_url",
        ];
        for key in keys {
            let args = serde_json::json!({ key: 4096 }).to_string();
            assert_eq!(scrub(&args), args, "key {key:?}");
        }
    }

    #[test]
    fn whole_value_is_redacted_whatever_its_type() {
        let args = r#"{"api_key":12345,"auth":{"user":"bob","password":"x"},"cookies":["a","b"],"password":null,"secret":true,"token":"","tries":3}"#;
        assert_eq!(
            scrub(args),
            r#"{"api_key":"[REDACTED]","auth":"[REDACTED]","cookies":"[REDACTED]","password":"[REDACTED]","secret":"[REDACTED]","token":"[REDACTED]","tries":3}"#
        );
    }

    #[test]
    fn nested_objects_and_arrays() {
        let gh = format!("ghp_{}", fake(36));
        let args = serde_json::json!({
            "steps": [
                { "tool": "http", "headers": { "Authorization": "Basic dXNlcjpwYXNz", "Accept": "json" } },
                { "tool": "db", "config": { "host": "db", "port": 5432, "credentials": { "user": "u", "password": "p" } } },
                [[{ "deep": { "refresh_token": ["r1", "r2"], "max_tokens": 100 } }]],
                format!("push with {gh}"),
            ],
            "usage": { "tokens_used": 1234, "token_count": 5 },
        })
        .to_string();
        let out = scrub_json(&args);
        assert_eq!(out["steps"][0]["headers"]["Authorization"], REDACTED);
        assert_eq!(out["steps"][0]["headers"]["Accept"], "json");
        assert_eq!(out["steps"][1]["config"]["credentials"], REDACTED);
        assert_eq!(out["steps"][1]["config"]["port"], 5432);
        assert_eq!(out["steps"][2][0][0]["deep"]["refresh_token"], REDACTED);
        assert_eq!(out["steps"][2][0][0]["deep"]["max_tokens"], 100);
        assert_eq!(out["steps"][3], "push with [REDACTED]");
        assert_eq!(out["usage"]["tokens_used"], 1234);
        assert_eq!(out["usage"]["token_count"], 5);
    }

    #[test]
    fn json_keeps_its_layout_order_and_numbers() {
        // Only the redacted value is rewritten: whitespace, key order and
        // the spelling of every number stay as given.
        let args = "{\n  \"z\": 1,\n  \"a\": [1, 2.5, -0.0, 1e300, 123456789012345678901234567890],\n  \"password\": \"x\"\n}";
        assert_eq!(
            scrub(args),
            "{\n  \"z\": 1,\n  \"a\": [1, 2.5, -0.0, 1e300, 123456789012345678901234567890],\n  \"password\": \"[REDACTED]\"\n}"
        );
        assert!(!Scrubber::new().is_clean(args));
        // Scalars are JSON too.
        assert_eq!(scrub(" 42 "), " 42 ", "nothing to redact: as given");
        assert_eq!(scrub(r#"{"b": 1, "a": 2}"#), r#"{"b": 1, "a": 2}"#);
        assert_eq!(
            scrub(&format!("\"{}\"", format_args!("ghp_{}", fake(36)))),
            "\"[REDACTED]\""
        );
        // A string that changes is written back with JSON's escapes.
        assert_eq!(
            scrub(&format!(r#"{{ "s": "a\"\\\u0001\/ ghp_{}" }}"#, fake(36))),
            r#"{ "s": "a\"\\\u0001/ [REDACTED]" }"#
        );
    }

    #[test]
    fn floats_survive_the_json_path_bit_for_bit() {
        // serde_json's default parser reads this one back one ULP off;
        // with `float_roundtrip` it is exact. The secret key sends the
        // arguments down the JSON path (past the prefilter).
        let args = r#"{"password":"x","x":1.0715660391465826e-75}"#;
        let out = scrub(args);
        let x = serde_json::from_str::<Value>(&out).expect("json")["x"]
            .as_f64()
            .expect("still a number");
        assert_eq!(x.to_bits(), 1.071_566_039_146_582_6e-75_f64.to_bits());
        // Random bit patterns: every finite float comes back exactly.
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..2000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let value = f64::from_bits(state);
            let Some(number) = serde_json::Number::from_f64(value) else {
                continue;
            };
            let args = format!(r#"{{"token":1,"v":[{number}]}}"#);
            let out = scrub(&args);
            let back = serde_json::from_str::<Value>(&out).expect("json")["v"][0]
                .as_f64()
                .expect("a number");
            assert_eq!(back.to_bits(), value.to_bits(), "{out}");
        }
    }

    #[test]
    fn plain_text_pairs() {
        let cases = [
            ("password=hunter2", "password=[REDACTED]"),
            (
                "user=bob password=hunter2 verbose",
                "user=bob password=[REDACTED] verbose",
            ),
            (
                "PGPASSWORD=hunter2 psql -h db",
                "PGPASSWORD=[REDACTED] psql -h db",
            ),
            (
                "export API_KEY=abc123; run",
                "export API_KEY=[REDACTED]; run",
            ),
            ("api_key: abc123", "api_key: [REDACTED]"),
            ("api-key : abc123", "api-key : [REDACTED]"),
            (
                "GET /v1?access_token=abc123&page=2",
                "GET /v1?access_token=[REDACTED]&page=2",
            ),
            ("password: 'two words'", "password: '[REDACTED]'"),
            (
                r#"{"password": "hunter2", "user": "bob""#,
                r#"{"password": "[REDACTED]", "user": "bob""#,
            ),
            (
                r#"{\"secret\": \"abc\"}"#,
                r#"{\"secret\": \"[REDACTED]\"}"#,
            ),
            ("token := \"abc\"", "token := \"[REDACTED]\""),
            ("'secret' => 'abc'", "'secret' => '[REDACTED]'"),
            (
                "Authorization: Basic dXNlcjpwYXNz",
                "Authorization: [REDACTED]",
            ),
            (
                "mysql --password hunter2 -u root",
                "mysql --password [REDACTED] -u root",
            ),
            ("gh --token=abc123 repo", "gh --token=[REDACTED] repo"),
            (
                "url: https://x.example/cb?token=abc123",
                "url: https://x.example/cb?token=[REDACTED]",
            ),
            (
                "password=\"unterminated\nnext",
                "password=\"[REDACTED]\nnext",
            ),
            ("Password=ümlaut€ rest", "Password=[REDACTED] rest"),
        ];
        for (input, expected) in cases {
            assert_eq!(scrub(input), expected, "input {input:?}");
        }
    }

    #[test]
    fn plain_text_pairs_left_alone() {
        for clean in [
            "max_tokens=100 user=bob",
            "token_count: 5",
            "password=",
            "password: ",
            "password = [1, 2]",
            "if token == other",
            "let t = token::Token::new()",
            "--password --verbose",
            "--max-tokens 100",
            "password=[REDACTED]",
            "Authorization: Bearer [REDACTED]",
            "password: \"\"",
        ] {
            assert_eq!(scrub(clean), clean, "input {clean:?}");
        }
    }

    #[test]
    fn pairs_inside_json_strings() {
        let args = r#"{"command":"PGPASSWORD=hunter2 psql -c 'select 1'"}"#;
        assert_eq!(
            scrub(args),
            r#"{"command":"PGPASSWORD=[REDACTED] psql -c 'select 1'"}"#
        );
    }

    #[test]
    fn scrub_text_applies_shapes_only() {
        assert_eq!(text("password=hunter2"), "password=hunter2");
        assert_eq!(text("password=AKIAIOSFODNN7EXAMPLE"), "password=[REDACTED]");
    }

    #[test]
    fn redaction_that_repairs_json_takes_the_json_path() {
        // A raw control character inside the PEM makes the JSON invalid;
        // once the block is gone the text is valid JSON.
        let key = pem("RSA ").replace('\n', "\u{1}");
        let args = format!("{{ \"key\": \"{key}\", \"b\": 1 }}");
        assert!(serde_json::from_str::<Value>(&args).is_err());
        assert_eq!(scrub(&args), r#"{ "key": "[REDACTED]", "b": 1 }"#);
    }

    #[test]
    fn deep_nesting_does_not_panic() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert_eq!(scrub(&deep), deep);
        let mut obj = r#"{"password":"hunter2","n":1}"#.to_owned();
        for _ in 0..200 {
            obj = format!(r#"{{"a":{obj}}}"#);
        }
        let out = scrub(&obj);
        assert!(out.contains(r#""password":"[REDACTED]""#), "{out}");
        assert!(!out.contains("hunter2"));
        // Deep but within the limit: the JSON path.
        let mut obj = r#"{"password":"hunter2"}"#.to_owned();
        for _ in 0..100 {
            obj = format!(r#"{{"a":[{obj}]}}"#);
        }
        assert!(scrub(&obj).contains(r#"{"password":"[REDACTED]"}"#));
        // Very deep text is fine too.
        let huge = format!("{}{}", "{\"a\":".repeat(20_000), "}".repeat(20_000));
        assert_eq!(Scrubber::new().scrub_arguments(&huge), huge);
    }

    #[test]
    fn odd_inputs_do_not_panic_and_are_idempotent() {
        let pieces = [
            "password",
            "token",
            "=",
            ":",
            " ",
            "\"",
            "'",
            "\\",
            "\\\"",
            "\n",
            "[REDACTED]",
            "[",
            "]",
            "{",
            "}",
            "Bearer ",
            "a1b2c3d4e5",
            "sk-",
            "ghp_",
            "AKIA",
            "eyJhbGciOi",
            ".",
            "é",
            "😀",
            "\u{0}",
            "-----BEGIN PRIVATE KEY-----",
            "-----END PRIVATE KEY-----",
            "://u:",
            "@",
            "--",
            "REDACTED",
            "xoxb-",
            "1e400",
            ",",
            "\u{2028}",
            "AIza",
            "0123456789abcdef",
        ];
        let scrubber = Scrubber::new()
            .with_secret_key("ssn")
            .with_pattern(r"\bID-[0-9]{4}\b")
            .expect("valid pattern");
        let mut state: u64 = 42;
        for _ in 0..500 {
            let mut input = String::new();
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let len = (state >> 58) as usize;
            for _ in 0..len {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                input.push_str(pieces[(state >> 33) as usize % pieces.len()]);
            }
            scrub_with(&scrubber, &input);
            scrub_with(
                &scrubber,
                &serde_json::json!({ "k": input, "password": 1 }).to_string(),
            );
        }
        for input in [
            "\u{FEFF}{}",
            "{\"a\":\"\\ud800\"}",
            "\u{0}\u{1}\u{7f}",
            "[REDACTED[REDACTED]]",
            "password=[REDACTED",
            "password=\\",
            "password=\\\"",
            "token: Bearer",
            "token: Bearer ",
            "Authorization: Bearer\n",
        ] {
            scrub_with(&scrubber, input);
        }
    }

    #[test]
    fn built_in_shapes_never_match_redacted() {
        for (shape, rule) in SHAPES.iter().zip(DEFAULT_RULES.iter()) {
            assert!(!rule.regex.is_match(REDACTED), "{}", shape.pattern);
            assert!(
                !rule.regex.is_match(&format!("x {REDACTED} y")),
                "{}",
                shape.pattern
            );
        }
        assert_eq!(SHAPES.len(), DEFAULT_RULES.len());
    }

    #[test]
    fn custom_secret_key() {
        let scrubber = Scrubber::new()
            .with_secret_key("SSN")
            .with_secret_key("Tax-Id");
        let out = scrub_with(
            &scrubber,
            r#"{"customer_ssn":"078-05-1120","taxId":"12-3456789","name":"Ann"}"#,
        );
        assert_eq!(
            out,
            r#"{"customer_ssn":"[REDACTED]","taxId":"[REDACTED]","name":"Ann"}"#
        );
        assert_eq!(
            scrub_with(&scrubber, "ssn=078-05-1120 ok"),
            "ssn=[REDACTED] ok"
        );
        // The default scrubber does not know it.
        assert_eq!(
            scrub(r#"{"ssn":"078-05-1120"}"#),
            r#"{"ssn":"078-05-1120"}"#
        );
        // A name that normalizes to nothing would match every key.
        let scrubber = Scrubber::new().with_secret_key(" -_. ");
        assert_eq!(scrub_with(&scrubber, r#"{"a":"b"}"#), r#"{"a":"b"}"#);
    }

    #[test]
    fn custom_pattern() {
        let scrubber = Scrubber::new()
            .with_pattern(r"\bACME-[0-9]{8}\b")
            .expect("valid pattern");
        assert_eq!(
            scrub_with(&scrubber, "ticket ACME-12345678 done"),
            "ticket [REDACTED] done"
        );
        assert_eq!(
            scrub_with(&scrubber, r#"{"note":["ACME-87654321"]}"#),
            r#"{"note":["[REDACTED]"]}"#
        );
        assert_eq!(scrubber.scrub_text("ACME-12345678"), REDACTED);
        // Built-in rules still apply.
        assert_eq!(scrub_with(&scrubber, "AKIAIOSFODNN7EXAMPLE"), REDACTED);
        // A `secret` group narrows what is replaced.
        let scrubber = Scrubber::new()
            .with_pattern(r"pin (?P<secret>[0-9]{4,})")
            .expect("valid pattern");
        assert_eq!(
            scrub_with(&scrubber, "card pin 123456 ok"),
            "card pin [REDACTED] ok"
        );
    }

    #[test]
    fn bad_custom_pattern_is_invalid() {
        for bad in [r"(unclosed", r"[z-a]", r"\p{NoSuchClass}"] {
            match Scrubber::new().with_pattern(bad) {
                Err(StateError::Invalid { what }) => {
                    assert!(what.contains("scrub pattern"), "{what}");
                }
                other => panic!("{bad:?}: expected Invalid, got {other:?}"),
            }
        }
    }

    #[test]
    fn pattern_matching_redacted_is_refused() {
        for bad in [
            r"\[REDACTED\]",
            r"REDACTED",
            r"[A-Z]+",
            r"\[",
            r"x*",
            r".*",
            r"(?i)redact",
        ] {
            match Scrubber::new().with_pattern(bad) {
                Err(StateError::Invalid { what }) => assert!(what.contains("[REDACTED]"), "{what}"),
                other => panic!("{bad:?}: expected Invalid, got {other:?}"),
            }
        }
        // A pattern that can only reach into `[REDACTED]` from outside is
        // accepted; the overlap rule keeps it idempotent.
        let scrubber = Scrubber::new()
            .with_pattern(r"D\]x+")
            .expect("valid pattern");
        assert_eq!(scrub_with(&scrubber, "[REDACTED]xx"), "[REDACTED]xx");
        assert_eq!(scrub_with(&scrubber, "D]xx"), REDACTED);
    }

    #[test]
    fn scrub_run_scrubs_every_pending_call() {
        let mut record = RunRecord::new(RunKey::new("acme", "run_1"), "planner");
        record.pending_tool_calls = vec![
            ToolCall {
                id: "call_1".into(),
                name: "http".into(),
                arguments: r#"{"url":"https://api.example.com","api_key":"abc123"}"#.into(),
            },
            ToolCall {
                id: "call_2".into(),
                name: "shell".into(),
                arguments: "export GITHUB_TOKEN=abc && git push".into(),
            },
            ToolCall {
                id: "call_3".into(),
                name: "noop".into(),
                arguments: "{}".into(),
            },
        ];
        let scrubbed = Scrubber::new().scrub_run(&record);
        assert_eq!(
            scrubbed.pending_tool_calls[0].arguments,
            r#"{"url":"https://api.example.com","api_key":"[REDACTED]"}"#
        );
        assert_eq!(
            scrubbed.pending_tool_calls[1].arguments,
            "export GITHUB_TOKEN=[REDACTED] && git push"
        );
        assert_eq!(scrubbed.pending_tool_calls[2], record.pending_tool_calls[2]);
        assert_eq!(scrubbed.pending_tool_calls[0].id, "call_1");
        assert_eq!(scrubbed.key, record.key);
        // The original is untouched, and a second scrub changes nothing.
        assert!(record.pending_tool_calls[0].arguments.contains("abc123"));
        assert_eq!(Scrubber::new().scrub_run(&scrubbed), scrubbed);
    }

    #[test]
    fn is_clean_reports_changes() {
        let scrubber = Scrubber::new();
        assert!(scrubber.is_clean(r#"{"a":1}"#));
        assert!(scrubber.is_clean(r#"{"password":"[REDACTED]"}"#));
        assert!(scrubber.is_clean("plain words"));
        assert!(!scrubber.is_clean(r#"{"password":"x"}"#));
        assert!(!scrubber.is_clean("token=abc"));
        assert!(scrubber.is_clean(r#"{ "b": 1, "a": 1 }"#));
        assert!(!scrubber.is_clean(r#"{ "a": 1, "token": "x" }"#));
    }

    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn default_shares_compiled_rules() {
        let a = Scrubber::default();
        let b = Scrubber::new();
        assert!(a.rules.is_none() && b.rules.is_none());
        assert!(std::ptr::eq(a.rules(), b.rules()));
        assert!(std::ptr::eq(a.rules(), &**DEFAULT_RULES));
        let c = a.clone().with_secret_key("pin");
        assert!(c.rules.is_none());
        let d = a
            .clone()
            .with_pattern(r"\bPIN-[0-9]{4}\b")
            .expect("valid pattern");
        assert_eq!(d.rules().len(), DEFAULT_RULES.len() + 1);
        send_sync::<Scrubber>();
    }
}
