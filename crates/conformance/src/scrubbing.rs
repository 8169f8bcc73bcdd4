//! X — scrubbing: every write stores the scrubbed record; secret keys and
//! secret shapes become `[REDACTED]`; scrubbing is idempotent (X1–X4).

use std::fmt::Display;

use super::helpers::*;
use super::{ConformanceStore, Factory};
use agentstate_core::{REDACTED, RunKey, RunRecord, RunState, Scrubber, StateDelta, StateQuery};

/// A GitHub token: `ghp_` and 36 letters and digits (built, not written
/// out, so secret scanners do not flag this file).
fn github_token() -> String {
    format!(
        "ghp_{}",
        "aB3dE5fG7hJ9kL1mN2pQ4rS6tU8vW0xY2zA4"
            .chars()
            .take(36)
            .collect::<String>()
    )
}

/// A Slack bot token.
fn slack_token() -> String {
    format!(
        "xoxb-{}-{}-{}",
        "123456789012", "1234567890123", "AbCdEfGhIjKlMnOpQrStUvWx"
    )
}

/// A JWT (the jwt.io example).
const JWT: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c";

/// The body of a PEM private-key block.
const PEM_BODY: &str = "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun";

fn pem_block() -> String {
    format!(
        "-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\nVTLw7onLRnrq0IzW7yWR7QkrmBL7jTKEn5uqKhbwKfBstIsbMY2Zkp18gnTxK\n-----END RSA PRIVATE KEY-----"
    )
}

/// Secrets planted in tool-call arguments, and what must survive them.
struct Planted {
    /// The arguments, as JSON text.
    args: String,
    /// Substrings that must not be stored.
    secrets: Vec<String>,
    /// Substrings that must survive.
    keep: Vec<&'static str>,
}

fn planted() -> Planted {
    let ghp = github_token();
    let args = serde_json::json!({
        "password": "hunter2",
        "q": "Bearer abcdefghijklmnop.qrstuvwx",
        "k": "sk-abcdefghijklmnopqrstuvwxyz123456",
        "gh": ghp,
        "aws": "AKIAIOSFODNN7EXAMPLE",
        "jwt": JWT,
        "city": "Paris",
    })
    .to_string();
    Planted {
        args,
        secrets: vec![
            "hunter2".into(),
            "abcdefghijklmnop.qrstuvwx".into(),
            "sk-abcdefghijklmnopqrstuvwxyz123456".into(),
            ghp,
            "AKIAIOSFODNN7EXAMPLE".into(),
            JWT.into(),
            "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c".into(),
        ],
        keep: vec!["Paris", "city"],
    }
}

/// X4: no stored argument holds a planted secret; the kept parts survive.
#[track_caller]
fn assert_clean(args: &str, secrets: &[String], keep: &[&str], ctx: impl Display) {
    for secret in secrets {
        assert!(
            !args.contains(secret.as_str()),
            "{ctx}: the store persisted the secret {secret:?} in {args:?} (X1–X4)"
        );
    }
    for k in keep {
        assert!(
            args.contains(k),
            "{ctx}: the non-secret {k:?} did not survive scrubbing: {args:?}"
        );
    }
}

/// Every tool call's arguments of `r`, as read from get_run and list_runs.
fn stored_arguments(s: &dyn ConformanceStore, k: &RunKey) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let r = must_get(s, k);
    out.extend(
        r.pending_tool_calls
            .iter()
            .map(|c| (format!("get_run {}", c.id), c.arguments.clone())),
    );
    for r in walk_runs(s, &StateQuery::new(&k.tenant))
        .iter()
        .filter(|r| r.key == *k)
    {
        out.extend(
            r.pending_tool_calls
                .iter()
                .map(|c| (format!("list_runs {}", c.id), c.arguments.clone())),
        );
    }
    out
}

/// X1: every write stores `record.scrubbed()`, never what it was handed:
/// creates and updates, as returned, read and listed.
pub fn x1_every_write_stores_scrubbed_record(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let p = planted();
    let key = RunKey::new(unique("x1"), "run");
    let mut rec = run_in(key.clone(), "planner", RunState::Running);
    rec.pending_tool_calls = vec![
        tool_call("json", &p.args),
        tool_call(
            "text",
            "token sk-abcdefghijklmnopqrstuvwxyz123456 from Paris, city",
        ),
    ];
    let v1 = create(s, rec.clone());
    let mut want = rec.scrubbed();
    (want.version, want.created_at, want.updated_at, want.seq) =
        (v1.version, v1.created_at, v1.updated_at, v1.seq);
    assert_eq!(v1, want, "X1: put_run returns record.scrubbed()");
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&want),
        "X1: the store holds record.scrubbed()"
    );
    for call in &v1.pending_tool_calls {
        assert_clean(
            &call.arguments,
            &p.secrets,
            &p.keep,
            format_args!("X1: create, returned call {}", call.id),
        );
    }
    for (at, args) in stored_arguments(s, &key) {
        assert_clean(&args, &p.secrets, &p.keep, format_args!("X1: create, {at}"));
    }

    // An update that hands new secrets.
    let mut u = must_get(s, &key);
    u.pending_tool_calls.push(tool_call(
        "update",
        &format!(r#"{{"api_key":"{}","city":"Paris"}}"#, github_token()),
    ));
    let v2 = ok(s.put_run(u.clone()), "X1: update");
    let mut want = u.scrubbed();
    (want.version, want.updated_at) = (v2.version, v2.updated_at);
    assert_eq!(v2, want, "X1: an update stores record.scrubbed()");
    for (at, args) in stored_arguments(s, &key) {
        assert_clean(
            &args,
            &p.secrets,
            &["Paris"],
            format_args!("X1: update, {at}"),
        );
    }
    // A patch keeps the scrubbed arguments.
    ok(
        s.patch_run(
            &key,
            StateDelta {
                iterations: 1,
                ..Default::default()
            },
        ),
        "X1: patch",
    );
    for (at, args) in stored_arguments(s, &key) {
        assert_clean(
            &args,
            &p.secrets,
            &["Paris"],
            format_args!("X1: after a patch, {at}"),
        );
    }
}

/// X2: values under keys that name secrets become `"[REDACTED]"`, whatever
/// the key's case and separators, at any depth; other values survive.
pub fn x2_secret_keys_redacted(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let args = serde_json::json!({
        "password": "p-one",
        "PASSWORD": "p-two",
        "secret": "s-one",
        "Secret": 424242,
        "token": "t-one",
        "api_key": "k-one",
        "apiKey": "k-two",
        "API-KEY": "k-three",
        "Api Key": "k-four",
        "authorization": "Basic dXNlcjpwYXNz",
        "Authorization": "a-two",
        "credential": {"user": "u-one", "pass": "c-one"},
        "private_key": "pk-one",
        "privateKey": "pk-two",
        "access_key": "ak-one",
        "AccessKey": "ak-two",
        "cookie": "session=c-two",
        "Cookie": "c-three",
        "login": {"password": "p-three", "user": "bob"},
        "list": [{"token": "t-two"}, {"city": "Lyon"}],
        "city": "Paris",
        "count": 3,
        "note": "nothing to hide",
    })
    .to_string();
    let key = RunKey::new(unique("x2"), "run");
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = vec![tool_call("c", &args)];
    create(s, rec);
    let secrets: Vec<String> = [
        "p-one",
        "p-two",
        "s-one",
        "424242",
        "t-one",
        "k-one",
        "k-two",
        "k-three",
        "k-four",
        "dXNlcjpwYXNz",
        "a-two",
        "u-one",
        "c-one",
        "pk-one",
        "pk-two",
        "ak-one",
        "ak-two",
        "c-two",
        "c-three",
        "p-three",
        "t-two",
    ]
    .map(String::from)
    .to_vec();
    let redacted_at = [
        "/password",
        "/PASSWORD",
        "/secret",
        "/Secret",
        "/token",
        "/api_key",
        "/apiKey",
        "/API-KEY",
        "/Api Key",
        "/authorization",
        "/Authorization",
        "/credential",
        "/private_key",
        "/privateKey",
        "/access_key",
        "/AccessKey",
        "/cookie",
        "/Cookie",
        "/login/password",
        "/list/0/token",
    ];
    let kept = [
        ("/city", serde_json::json!("Paris")),
        ("/count", serde_json::json!(3)),
        ("/note", serde_json::json!("nothing to hide")),
        ("/login/user", serde_json::json!("bob")),
        ("/list/1/city", serde_json::json!("Lyon")),
    ];
    for (at, stored) in stored_arguments(s, &key) {
        assert_clean(&stored, &secrets, &["Paris"], format_args!("X2: {at}"));
        let v: serde_json::Value = serde_json::from_str(&stored).unwrap_or_else(|e| {
            panic!("X2: {at}: scrubbed JSON arguments must stay JSON ({e}): {stored:?}")
        });
        for ptr in redacted_at {
            assert_eq!(
                v.pointer(ptr),
                Some(&serde_json::Value::String(REDACTED.to_string())),
                "X2: {at}: the value at {ptr:?} names a secret and must be {REDACTED:?}; stored {stored}"
            );
        }
        for (ptr, want) in &kept {
            assert_eq!(
                v.pointer(ptr),
                Some(want),
                "X2: {at}: the non-secret value at {ptr:?} must survive; stored {stored}"
            );
        }
    }
}

/// X3: secret-shaped strings are redacted anywhere in the arguments
/// (bearer tokens, `sk-` keys, GitHub and Slack tokens, AWS key ids, JWTs,
/// PEM private keys); arguments that are not JSON are scrubbed as text.
pub fn x3_secret_shapes_redacted_anywhere(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let (ghp, slack, pem) = (github_token(), slack_token(), pem_block());
    let json = serde_json::json!({
        "note": "call it with Bearer abcdefghijklmnop.qrstuvwx please",
        "list": ["sk-abcdefghijklmnopqrstuvwxyz123456", {"deep": [ghp]}],
        "aws": "the key AKIAIOSFODNN7EXAMPLE is here",
        "slack": slack,
        "header": JWT,
        "file": pem,
        "city": "Paris",
    })
    .to_string();
    let text = format!(
        "curl -H 'Authorization: Bearer abcdefghijklmnop.qrstuvwx' 'https://api.example.com/?k=sk-abcdefghijklmnopqrstuvwxyz123456' \
         AKIAIOSFODNN7EXAMPLE {slack} {ghp} {JWT} {pem} from Paris"
    );
    let secrets: Vec<String> = vec![
        "abcdefghijklmnop.qrstuvwx".into(),
        "sk-abcdefghijklmnopqrstuvwxyz123456".into(),
        ghp.clone(),
        "AKIAIOSFODNN7EXAMPLE".into(),
        slack.clone(),
        JWT.into(),
        "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c".into(),
        PEM_BODY.into(),
    ];
    let key = RunKey::new(unique("x3"), "run");
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = vec![tool_call("json", &json), tool_call("text", &text)];
    create(s, rec);
    for (at, stored) in stored_arguments(s, &key) {
        assert_clean(&stored, &secrets, &["Paris"], format_args!("X3: {at}"));
        assert!(
            stored.contains(REDACTED),
            "X3: {at}: redactions are marked {REDACTED:?}: {stored:?}"
        );
        if at.ends_with("json") {
            let v: std::result::Result<serde_json::Value, _> = serde_json::from_str(&stored);
            assert!(
                v.is_ok(),
                "X3: {at}: scrubbed JSON arguments must stay JSON: {stored:?}"
            );
        }
    }

    // A secret used as an object key, at the top and nested, and two that
    // scrub to the same name: no key is persisted, no entry is lost.
    let stripe = format!("sk_live_{}", "aB3dE5fG7hJ9kL1mN2pQ4rS6");
    let keyed = serde_json::json!({
        stripe.clone(): "value",
        "config": { "auth": { ghp.clone(): { "scopes": "repo" } }, "city": "Paris" },
        "pair": { ghp.clone(): 1, slack.clone(): 2 },
    })
    .to_string();
    let key = RunKey::new(unique("x3keys"), "run");
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = vec![tool_call("keys", &keyed)];
    create(s, rec);
    let key_secrets = vec![stripe.clone(), ghp.clone(), slack.clone()];
    for (at, stored) in stored_arguments(s, &key) {
        assert_clean(
            &stored,
            &key_secrets,
            &["Paris", "value"],
            format_args!("X3: a secret as an object key, {at}"),
        );
        let v: serde_json::Value = serde_json::from_str(&stored).unwrap_or_else(|e| {
            panic!("X3: {at}: scrubbed JSON arguments must stay JSON ({e}): {stored:?}")
        });
        assert_eq!(
            v.as_object().map(|o| o.len()),
            Some(3),
            "X3: {at}: a redacted key is kept (renamed), not dropped: {stored}"
        );
        assert_eq!(
            v["pair"].as_object().map(|o| o.len()),
            Some(2),
            "X3: {at}: two secret keys of one object stay two entries: {stored}"
        );
    }
}

/// X4: scrubbing is idempotent (scrubbing stored arguments changes nothing)
/// and the suite fails a store that persists a secret.
pub fn x4_scrubbing_idempotent_no_secret_persists(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let p = planted();
    // The default rules are what X4 names; `default()` stays right whatever
    // fields the scrubber grows.
    #[allow(clippy::default_constructed_unit_structs)]
    let scrubber = Scrubber::default();
    let inputs: Vec<String> = vec![
        p.args.clone(),
        format!(
            "Bearer abcdefghijklmnop.qrstuvwx and {} and {JWT}",
            github_token()
        ),
        pem_block(),
        String::new(),
        "{}".into(),
        "[]".into(),
        REDACTED.into(),
        format!("{REDACTED}{REDACTED}"),
        format!(r#"{{"password":"{REDACTED}","city":"Paris"}}"#),
        r#"{"password": {"nested": ["a", 1, null]}, "list": [[["token"]]]}"#.into(),
        r#"{"password":"unterminated"#.into(),
        "plain words, no secrets, ünïcödé ☃".into(),
        r#""just a JSON string with sk-abcdefghijklmnopqrstuvwxyz123456""#.into(),
    ];
    for input in &inputs {
        let once = scrubber.scrub_arguments(input);
        assert_eq!(
            scrubber.scrub_arguments(&once),
            once,
            "X4: scrubbing {input:?} twice differs from once"
        );
    }
    let key = RunKey::new(unique("x4"), "run");
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = inputs
        .iter()
        .enumerate()
        .map(|(i, a)| tool_call(&format!("c{i}"), a))
        .collect();
    create(s, rec);
    let stored = must_get(s, &key);
    assert_eq!(
        stored.scrubbed(),
        stored,
        "X4: a stored run scrubs to itself"
    );
    for (at, args) in stored_arguments(s, &key) {
        assert_eq!(
            scrubber.scrub_arguments(&args),
            args,
            "X4: {at}: scrubbing stored arguments changes them"
        );
    }
    let (_, planted_args) = stored_arguments(s, &key)
        .into_iter()
        .find(|(at, _)| at == "get_run c0")
        .expect("call c0");
    assert_clean(&planted_args, &p.secrets, &p.keep, "X4: get_run c0");
    for (at, args) in stored_arguments(s, &key) {
        assert_clean(&args, &p.secrets, &[], format_args!("X4: {at}"));
    }
}
