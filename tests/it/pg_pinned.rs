//! The PostgreSQL backend sharing one database with pinned 0.16's own
//! `PostgresStateStore` (schema 9): pinned's tables set up first or second
//! or at the same moment, rows written by pinned's statements read here and
//! the other way round, docs byte for byte, fences in both directions,
//! foreign rows that never make a call panic, the column check of
//! `setup()`, the upgrade of older databases, and listings in byte order
//! over their indexes in a database whose collation is not bytes.
//!
//! pinned's SQL below is its own, copied as test data: its two `CREATE
//! TABLE` statements, its acquire (lock, insert, compare, raise) and its
//! upsert.

use std::collections::BTreeSet;
use std::sync::{Arc, Barrier};

use agentstate::{
    IdempotencyKey, InstanceKey, PageRequest, PersistenceReason, PostgresStore, StateError,
    StoreAdmin, Tray, TrayFilter, TrayKey, TrayOp, TrayStore,
};

use crate::pg_server::{fresh_db, shared_dsn, with_db};

/// pinned 0.16's `setup()`, verbatim.
const PINNED_EPOCH_DDL: &str = "CREATE TABLE IF NOT EXISTS pinned_epoch (ns TEXT NOT NULL, id TEXT NOT NULL, epoch BIGINT NOT NULL, PRIMARY KEY (ns, id))";
const PINNED_TRAY_DDL: &str = "CREATE TABLE IF NOT EXISTS pinned_tray_index (ns TEXT NOT NULL, id TEXT NOT NULL, tray_ns TEXT NOT NULL, tray_id TEXT NOT NULL, marked BOOLEAN NOT NULL, doc JSONB NOT NULL, env TEXT NOT NULL DEFAULT '*', hostname TEXT NOT NULL DEFAULT '*', PRIMARY KEY (ns, id, tray_ns, tray_id))";

/// A new database whose default collation is ICU's `en-US` (where "a" <
/// "B", unlike bytes), so byte order has to be asked for.
fn icu_db(tag: &str) -> String {
    let plain = fresh_db(tag);
    let name = format!("{}_icu", plain.rsplit('/').next().expect("a database"));
    let mut c = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("connect");
    c.batch_execute(&format!(
        "CREATE DATABASE {name} TEMPLATE template0 ENCODING UTF8 LOCALE_PROVIDER icu \
         ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
    ))
    .expect("an ICU database");
    let dsn = with_db(shared_dsn(), &name);
    let mut c = raw(&dsn);
    let lt: bool = c.query_one("SELECT 'a' < 'B'", &[]).expect("q").get(0);
    assert!(lt, "the database orders by ICU, not by bytes");
    dsn
}

fn raw(dsn: &str) -> postgres::Client {
    postgres::Client::connect(dsn, postgres::NoTls).expect("a raw connection")
}

fn pinned_setup(c: &mut postgres::Client) {
    let mut t = c.transaction().expect("begin");
    t.batch_execute(PINNED_EPOCH_DDL).expect("pinned_epoch");
    t.batch_execute(PINNED_TRAY_DDL).expect("pinned_tray_index");
    t.commit().expect("commit");
}

/// pinned's `_acquire` in `t`: lock, insert the caller's epoch when there
/// is no row, refuse an epoch below the stored one, store a newer one.
/// `Err(stored)` when pinned raises `FenceLost`.
fn pinned_acquire(
    t: &mut postgres::Transaction<'_>,
    ns: &str,
    id: &str,
    epoch: i64,
) -> Result<(), i64> {
    let sel = "SELECT epoch FROM pinned_epoch WHERE ns = $1 AND id = $2 FOR UPDATE";
    let mut stored: Option<i64> = t
        .query_opt(sel, &[&ns, &id])
        .expect("lock")
        .map(|r| r.get(0));
    if stored.is_none() {
        t.execute(
            "INSERT INTO pinned_epoch (ns, id, epoch) VALUES ($1, $2, $3) \
             ON CONFLICT (ns, id) DO NOTHING",
            &[&ns, &id, &epoch],
        )
        .expect("insert");
        stored = t
            .query_opt(sel, &[&ns, &id])
            .expect("lock")
            .map(|r| r.get(0));
    }
    let stored = stored.expect("the row");
    if epoch < stored {
        return Err(stored);
    }
    if epoch > stored {
        t.execute(
            "UPDATE pinned_epoch SET epoch = $1 WHERE ns = $2 AND id = $3",
            &[&epoch, &ns, &id],
        )
        .expect("update");
    }
    Ok(())
}

/// pinned's `set_tray`: one transaction, its acquire then its upsert of a
/// JSON object (`doc`, JSON text).
#[allow(clippy::too_many_arguments)]
fn pinned_set_tray(
    c: &mut postgres::Client,
    ns: &str,
    id: &str,
    tray_ns: &str,
    tray_id: &str,
    marked: bool,
    doc: &str,
    epoch: i64,
) -> Result<(), i64> {
    let mut t = c.transaction().expect("begin");
    pinned_acquire(&mut t, ns, id, epoch)?;
    t.execute(
        "INSERT INTO pinned_tray_index (ns, id, tray_ns, tray_id, marked, doc, env, hostname) \
         VALUES ($1, $2, $3, $4, $5, $6::text::jsonb, $7, $8) \
         ON CONFLICT (ns, id, tray_ns, tray_id) \
         DO UPDATE SET marked = EXCLUDED.marked, doc = EXCLUDED.doc, \
         env = EXCLUDED.env, hostname = EXCLUDED.hostname",
        &[&ns, &id, &tray_ns, &tray_id, &marked, &doc, &"*", &"*"],
    )
    .expect("pinned's upsert");
    t.commit().expect("commit");
    Ok(())
}

/// pinned's `get_tray`: the doc as jsonb's text.
fn pinned_get_tray(
    c: &mut postgres::Client,
    ns: &str,
    id: &str,
    tray_ns: &str,
    tray_id: &str,
    epoch: i64,
) -> Result<Option<(bool, String)>, i64> {
    let mut t = c.transaction().expect("begin");
    pinned_acquire(&mut t, ns, id, epoch)?;
    let row = t
        .query_opt(
            "SELECT marked, doc::text FROM pinned_tray_index \
             WHERE ns = $1 AND id = $2 AND tray_ns = $3 AND tray_id = $4",
            &[&ns, &id, &tray_ns, &tray_id],
        )
        .expect("pinned's read");
    t.commit().expect("commit");
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

/// The columns of the two tables as `(table, column, type, default
/// collation?, default)`, in order.
fn columns(c: &mut postgres::Client) -> Vec<(String, String, String, bool, Option<String>)> {
    c.query(
        "SELECT c.relname::text, a.attname::text, format_type(a.atttypid, a.atttypmod), \
         a.attcollation IN (0, (SELECT oid FROM pg_collation WHERE collname = 'default')), \
         pg_get_expr(d.adbin, d.adrelid) \
         FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
         LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
         WHERE c.relname IN ('pinned_epoch', 'pinned_tray_index') \
         AND c.relnamespace = 'public'::regnamespace AND a.attnum > 0 AND NOT a.attisdropped \
         ORDER BY c.relname, a.attnum",
        &[],
    )
    .expect("columns")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
    .collect()
}

/// The tables are exactly pinned's (plus agentstate's nullable `doc_raw`).
fn assert_pinned_shape(c: &mut postgres::Client) {
    let t = |t: &str, c: &str, ty: &str, d: Option<&str>| {
        (
            t.to_string(),
            c.to_string(),
            ty.to_string(),
            true,
            d.map(str::to_string),
        )
    };
    let star = Some("'*'::text");
    assert_eq!(
        columns(c),
        [
            t("pinned_epoch", "ns", "text", None),
            t("pinned_epoch", "id", "text", None),
            t("pinned_epoch", "epoch", "bigint", None),
            t("pinned_tray_index", "ns", "text", None),
            t("pinned_tray_index", "id", "text", None),
            t("pinned_tray_index", "tray_ns", "text", None),
            t("pinned_tray_index", "tray_id", "text", None),
            t("pinned_tray_index", "marked", "boolean", None),
            t("pinned_tray_index", "doc", "jsonb", None),
            t("pinned_tray_index", "env", "text", star),
            t("pinned_tray_index", "hostname", "text", star),
            t("pinned_tray_index", "doc_raw", "bytea", None),
        ]
    );
    let checks: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_constraint WHERE contype = 'c' \
             AND conrelid IN ('public.pinned_epoch'::regclass, 'public.pinned_tray_index'::regclass)",
            &[],
        )
        .expect("checks")
        .get(0);
    assert_eq!(checks, 0, "no CHECK pinned's writes could trip on");
}

fn tray(marked: bool, doc: &[u8]) -> Tray {
    Tray {
        marked,
        doc: doc.to_vec(),
        env: "prod".into(),
        hostname: "h1".into(),
    }
}

/// Walks `list_trays` to the end, pages of `limit`.
fn list_all(s: &PostgresStore, i: &InstanceKey, epoch: u64, limit: usize) -> Vec<(TrayKey, Tray)> {
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let page = s
            .list_trays(i, epoch, &PageRequest::new(limit).with_cursor(cursor))
            .expect("list_trays");
        out.extend(page.items().iter().cloned());
        cursor = page.cursor().cloned();
        if cursor.is_none() {
            return out;
        }
    }
}

/// Walks `marked_trays` to the end.
fn marked_all(s: &PostgresStore, env: Option<&str>, limit: usize) -> Vec<TrayKey> {
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let page = s
            .marked_trays(env, &PageRequest::new(limit).with_cursor(cursor))
            .expect("marked_trays");
        out.extend(page.items().iter().map(|m| m.key.clone()));
        cursor = page.cursor().cloned();
        if cursor.is_none() {
            return out;
        }
    }
}

/// pinned set the database up and wrote first; then `setup()` leaves its
/// tables as they are and the store reads, writes and fences its rows, and
/// pinned reads what the store wrote.
#[test]
fn pinned_first_then_setup_shares_its_rows() {
    let dsn = icu_db("pinfirst");
    let mut c = raw(&dsn);
    pinned_setup(&mut c);
    pinned_set_tray(&mut c, "py", "w1", "chat", "a", true, r#"{"n": 1}"#, 5).expect("set");
    pinned_set_tray(
        &mut c,
        "py",
        "w1",
        "chat",
        "B",
        false,
        r#"{"z":[1,2],"a":null}"#,
        5,
    )
    .expect("set");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup after pinned");
    s.setup().expect("setup again");
    assert_eq!(s.schema_version().expect("version"), Some(10));
    assert_pinned_shape(&mut c);
    let w = InstanceKey::new("py", "w1");
    assert_eq!(s.epoch(&w).expect("epoch"), 5, "pinned's epoch");
    // pinned's docs read as jsonb's text.
    let a = s
        .read_tray(&w.tray("chat", "a"), 5)
        .expect("read")
        .expect("a");
    assert_eq!((a.marked, a.doc.as_slice()), (true, &br#"{"n": 1}"#[..]));
    assert_eq!((a.env.as_str(), a.hostname.as_str()), ("*", "*"));
    let b = s
        .read_tray(&w.tray("chat", "B"), 5)
        .expect("read")
        .expect("B");
    assert_eq!(b.doc, br#"{"a": null, "z": [1, 2]}"#);
    // Byte order, not the database's: "B" before "a".
    let listed: Vec<String> = list_all(&s, &w, 5, 1)
        .into_iter()
        .map(|(k, _)| k.tray_id)
        .collect();
    assert_eq!(listed, ["B", "a"]);
    // A stale epoch is fenced by pinned's.
    let e = s.read_tray(&w.tray("chat", "a"), 4).expect_err("stale");
    assert!(
        matches!(
            e,
            StateError::FenceLost {
                caller: 4,
                stored: 5,
                ..
            }
        ),
        "{e:?}"
    );
    // The store writes at 6: pinned at 5 is fenced, and reads the store's
    // JSON doc as the same document.
    s.write_tray(
        &w.tray("chat", "c"),
        6,
        tray(true, br#"{"b":1, "a" : "x"}"#),
    )
    .expect("write");
    assert_eq!(
        pinned_set_tray(&mut c, "py", "w1", "chat", "a", false, "{}", 5),
        Err(6),
        "pinned is fenced by the store's epoch"
    );
    assert_eq!(
        pinned_get_tray(&mut c, "py", "w1", "chat", "c", 6).expect("pinned reads"),
        Some((true, r#"{"a": "x", "b": 1}"#.to_string()))
    );
    // And the store, at its own epoch, reads its bytes exactly.
    let c_doc = s
        .read_tray(&w.tray("chat", "c"), 6)
        .expect("read")
        .expect("c");
    assert_eq!(c_doc.doc, br#"{"b":1, "a" : "x"}"#);
    // pinned moves on to 7: the store at 6 is fenced.
    pinned_set_tray(&mut c, "py", "w1", "chat", "a", false, r#"{"n": 2}"#, 7).expect("pinned at 7");
    let e = s
        .write_tray(&w.tray("chat", "a"), 6, tray(false, b"x"))
        .expect_err("fenced");
    assert!(
        matches!(
            e,
            StateError::FenceLost {
                caller: 6,
                stored: 7,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(s.verify().expect("verify").is_ok());
}

/// agentstate set the database up first: pinned's `setup()` creates
/// nothing, and pinned's upsert and read work on the store's rows.
#[test]
fn setup_first_then_pinned_writes_and_reads() {
    let dsn = icu_db("asfirst");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let mut c = raw(&dsn);
    pinned_setup(&mut c);
    assert_pinned_shape(&mut c);
    let w = InstanceKey::new("py", "w2");
    s.write_tray(&w.tray("chat", "t"), 1, tray(true, b"not json"))
        .expect("write");
    // pinned reads a non-JSON doc as an object naming its bytes.
    let (marked, doc) = pinned_get_tray(&mut c, "py", "w2", "chat", "t", 1)
        .expect("read")
        .expect("row");
    assert!(marked);
    assert_eq!(
        doc,
        format!(r#"{{"agentstate:hex": "{}"}}"#, hex(b"not json"))
    );
    // pinned's upsert over it: the store reads pinned's doc.
    pinned_set_tray(
        &mut c,
        "py",
        "w2",
        "chat",
        "t",
        false,
        r#"{"b": 2, "a": [1]}"#,
        1,
    )
    .expect("pinned's upsert");
    let t = s
        .read_tray(&w.tray("chat", "t"), 1)
        .expect("read")
        .expect("t");
    assert_eq!(t.doc, br#"{"a": [1], "b": 2}"#);
    assert!(!t.marked);
    assert_eq!((t.env.as_str(), t.hostname.as_str()), ("*", "*"));
    let raws: i64 = c
        .query_one("SELECT count(doc_raw) FROM pinned_tray_index", &[])
        .expect("q")
        .get(0);
    assert_eq!(raws, 0, "pinned's write cleared the store's raw bytes");
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A doc reads back byte for byte, whatever its bytes (T1), through every
/// read (point read, listing, export, feed); what SQL sees is the JSON
/// document when the bytes are one, else `{"agentstate:hex": …}`; and
/// `doc_raw` holds bytes only where jsonb's text differs.
#[test]
fn docs_round_trip_byte_for_byte() {
    let dsn = fresh_db("docs");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let mut c = raw(&dsn);
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    let tiny = format!("0.{}1", "0".repeat(20_000));
    // jsonb turns a \u escape of a non-ASCII character into the character
    // only in a UTF-8 database; elsewhere it refuses the doc, which is
    // then stored as hex (and still reads back exactly).
    let utf8: String = c
        .query_one("SELECT current_setting('server_encoding')", &[])
        .expect("encoding")
        .get(0);
    let escaped = (utf8 == "UTF8").then_some(r#"{"k": "é", "l": "é"}"#);
    // (doc, stored as this JSON value (None: the hex object), doc_raw NULL)
    let docs: Vec<(Vec<u8>, Option<&str>, bool)> = vec![
        (b"hello".to_vec(), None, false),
        (vec![0, 255, 1, 2], None, false),
        (Vec::new(), None, false),
        (vec![0xc3, 0x28], None, false),
        (
            br#"{ "b" : 1 ,"a":2 }"#.to_vec(),
            Some(r#"{"a": 2, "b": 1}"#),
            false,
        ),
        (
            br#"{"a": 2, "b": 1}"#.to_vec(),
            Some(r#"{"a": 2, "b": 1}"#),
            true,
        ),
        (br#"{"a":"\u0000"}"#.to_vec(), None, false),
        (br#""\ud800""#.to_vec(), None, false),
        (b"42".to_vec(), Some("42"), true),
        (b"null".to_vec(), Some("null"), true),
        (br#"[1, "x"]"#.to_vec(), Some(r#"[1, "x"]"#), true),
        (
            r#"{"k": "\u00e9", "l": "é"}"#.as_bytes().to_vec(),
            escaped,
            false,
        ),
        (
            br#"{"agentstate:hex": "6869"}"#.to_vec(),
            Some(r#"{"agentstate:hex": "6869"}"#),
            true,
        ),
        (br#"{"a":1,"a":2}"#.to_vec(), Some(r#"{"a": 2}"#), false),
        (
            b"123456789012345678901234567890".to_vec(),
            Some("123456789012345678901234567890"),
            true,
        ),
        // Deeper than many parsers go, but one JSON document: jsonb's.
        (deep.clone().into_bytes(), Some(deep.as_str()), true),
        (tiny.clone().into_bytes(), None, false),
        (b" {} ".to_vec(), Some("{}"), false),
    ];
    let w = InstanceKey::new("docs", "w");
    let v = InstanceKey::new("docs", "v");
    let mut ops = Vec::new();
    for (i, (doc, _, _)) in docs.iter().enumerate() {
        s.write_tray(&w.tray("d", format!("{i:02}")), 1, tray(i % 2 == 0, doc))
            .expect("write");
        ops.push(TrayOp::Put {
            tray_ns: "d".into(),
            tray_id: format!("{i:02}"),
            tray: tray(i % 2 == 1, doc),
        });
    }
    s.apply_batch(&v, 1, ops).expect("batch");
    for (i, (doc, json, canonical)) in docs.iter().enumerate() {
        let id = format!("{i:02}");
        for inst in [&w, &v] {
            let t = s
                .read_tray(&inst.tray("d", &id), 1)
                .expect("read")
                .expect("the tray");
            assert_eq!(&t.doc, doc, "doc {i} read back");
            let r = c
                .query_one(
                    "SELECT doc::text, doc_raw IS NULL, doc ->> 'agentstate:hex' \
                     FROM pinned_tray_index WHERE ns = 'docs' AND id = $1 AND tray_id = $2",
                    &[&inst.id, &id],
                )
                .expect("the row");
            let (text, raw_null, hexed): (String, bool, Option<String>) =
                (r.get(0), r.get(1), r.get(2));
            match json {
                Some(j) => assert_eq!(text, *j, "doc {i} as SQL sees it"),
                None => assert_eq!(hexed.as_deref(), Some(hex(doc).as_str()), "doc {i} hex"),
            }
            assert_eq!(
                raw_null, *canonical,
                "doc {i}: doc_raw only where the text differs"
            );
        }
    }
    let listed: Vec<Vec<u8>> = list_all(&s, &v, 1, 5)
        .into_iter()
        .map(|(_, t)| t.doc)
        .collect();
    let want: Vec<Vec<u8>> = docs.iter().map(|d| d.0.clone()).collect();
    assert_eq!(listed, want, "list_trays reads every doc exactly");
    let mut exported = Vec::new();
    let mut cursor = None;
    loop {
        let page = s
            .export_page(&PageRequest::new(7).with_cursor(cursor))
            .expect("export");
        for e in page.items() {
            if let agentstate::Entry::Tray { key, tray } = e
                && key.id == "v"
            {
                exported.push(tray.doc.clone());
            }
        }
        cursor = page.cursor().cloned();
        if cursor.is_none() {
            break;
        }
    }
    assert_eq!(exported, want, "export reads every doc exactly");
    // A foreign write that changes the doc clears the raw bytes (pinned's
    // upsert, a plain UPDATE); one that leaves the doc keeps them.
    c.batch_execute("UPDATE pinned_tray_index SET marked = NOT marked WHERE ns = 'docs' AND id = 'v' AND tray_id = '00'")
        .expect("a foreign update of marked");
    let t = s
        .read_tray(&v.tray("d", "00"), 1)
        .expect("read")
        .expect("00");
    assert_eq!(t.doc, b"hello", "doc untouched: the exact bytes stay");
    c.batch_execute(r#"UPDATE pinned_tray_index SET doc = '{"new": true}' WHERE ns = 'docs' AND id = 'v' AND tray_id = '04'"#)
        .expect("a foreign update of doc");
    let t = s
        .read_tray(&v.tray("d", "04"), 1)
        .expect("read")
        .expect("04");
    assert_eq!(
        t.doc, br#"{"new": true}"#,
        "the foreign doc, not stale raw bytes"
    );
    // A huge JSON doc within the limit round-trips too.
    let big = format!(r#"{{"k": "{}"}}"#, "x".repeat(900_000));
    s.write_tray(&w.tray("d", "big"), 1, tray(false, big.as_bytes()))
        .expect("a big doc");
    let t = s
        .read_tray(&w.tray("d", "big"), 1)
        .expect("read")
        .expect("big");
    assert_eq!(t.doc, big.as_bytes());
    assert!(s.verify().expect("verify").is_ok());
}

/// Every row anyone can put in the tables — pinned's writes, plain SQL
/// with NULL where a column allows it, JSON that is no object, a 5 MB
/// doc, ids pinned accepts and this store would not write — reads without
/// a panic; a row that does not decode at all (a column another tool
/// loosened after setup) is `Corrupt` naming its key on a point read and
/// left out of listings, which go on.
#[test]
fn foreign_rows_never_panic() {
    let dsn = fresh_db("zoo");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let mut c = raw(&dsn);
    let long = "L".repeat(300);
    let huge = format!(r#"{{"big": "{}"}}"#, "y".repeat(5 * 1024 * 1024));
    let rows: Vec<(&str, &str, &str, &str, String)> = vec![
        ("zoo", "w", "t", "num", "42".into()),
        ("zoo", "w", "t", "str", r#""s""#.into()),
        ("zoo", "w", "t", "arr", "[1, 2]".into()),
        ("zoo", "w", "t", "null", "null".into()),
        ("zoo", "w", "t", "huge", huge.clone()),
        ("zoo", "w", "", "", "{}".into()),
        ("zoo", "w", "t", &long, "{}".into()),
        ("zoo", "w", "t", "x\u{1}y", "{}".into()),
        ("", "", "t", "t", "{}".into()),
        ("zoo", &long, "t", "t", "{}".into()),
    ];
    for (ns, id, tns, tid, doc) in &rows {
        c.execute(
            "INSERT INTO pinned_tray_index (ns, id, tray_ns, tray_id, marked, doc, doc_raw) \
             VALUES ($1, $2, $3, $4, true, $5::text::jsonb, NULL)",
            &[ns, id, tns, tid, doc],
        )
        .expect("a foreign row");
    }
    let w = InstanceKey::new("zoo", "w");
    for (tid, want) in [
        ("num", "42".to_string()),
        ("str", r#""s""#.to_string()),
        ("arr", "[1, 2]".to_string()),
        ("null", "null".to_string()),
        ("huge", huge.clone()),
    ] {
        let t = s.read_tray(&w.tray("t", tid), 1).expect("read").expect(tid);
        assert_eq!(String::from_utf8(t.doc).expect("text"), want, "{tid}");
    }
    // The ids this store would refuse are listed as their text.
    let listed: BTreeSet<(String, String)> = list_all(&s, &w, 1, 3)
        .into_iter()
        .map(|(k, _)| (k.tray_ns, k.tray_id))
        .collect();
    assert_eq!(listed.len(), 8, "{listed:?}");
    assert!(listed.contains(&(String::new(), String::new())));
    assert!(listed.contains(&("t".to_string(), long.clone())));
    assert!(listed.contains(&("t".to_string(), "x\u{1}y".to_string())));
    let marked = marked_all(&s, None, 4);
    assert_eq!(marked.len(), rows.len(), "every marked row once");
    assert!(marked.iter().any(|k| k.ns.is_empty() && k.id.is_empty()));
    // A row that cannot be read: hostname NULL after another tool
    // loosened the column.
    c.batch_execute(
        "ALTER TABLE pinned_tray_index ALTER COLUMN hostname DROP NOT NULL; \
         INSERT INTO pinned_tray_index (ns, id, tray_ns, tray_id, marked, doc, env, hostname) \
         VALUES ('zoo', 'w', 't', 'broken', true, '{}', 'prod', NULL)",
    )
    .expect("a row that does not decode");
    let e = s
        .read_tray(&w.tray("t", "broken"), 1)
        .expect_err("a row that does not decode");
    assert!(matches!(e, StateError::Corrupt { .. }), "{e:?}");
    let msg = e.to_string();
    for part in ["zoo", "w", "t", "broken", "hostname"] {
        assert!(msg.contains(part), "{msg} names {part}");
    }
    assert!(
        s.read_tray(&w.tray("t", "num"), 1)
            .expect("another tray")
            .is_some(),
        "the other trays still read"
    );
    assert_eq!(list_all(&s, &w, 1, 2).len(), 8, "the listing leaves it out");
    assert_eq!(
        marked_all(&s, None, 3).len(),
        rows.len(),
        "so does the sweep"
    );
    assert_eq!(marked_all(&s, Some("prod"), 3).len(), 0);
    s.verify().expect("verify reads past them");
}

/// An epoch past i64::MAX is `Invalid` naming it and the bound, on every
/// tray call, and changes nothing; i64::MAX itself works.
#[test]
fn epochs_past_i64_max_are_invalid() {
    let dsn = fresh_db("epochmax");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let w = InstanceKey::new("e", "w");
    s.write_tray(&w.tray("t", "a"), 3, tray(true, b"x"))
        .expect("write at 3");
    let max = i64::MAX as u64;
    for bad in [max + 1, u64::MAX] {
        let calls: Vec<(&str, agentstate::Result<()>)> = vec![
            ("read_tray", s.read_tray(&w.tray("t", "a"), bad).map(drop)),
            (
                "write_tray",
                s.write_tray(&w.tray("t", "a"), bad, tray(false, b"y")),
            ),
            (
                "delete_tray",
                s.delete_tray(&w.tray("t", "a"), bad).map(drop),
            ),
            (
                "apply_batch",
                s.apply_batch(
                    &w,
                    bad,
                    vec![TrayOp::Delete {
                        tray_ns: "t".into(),
                        tray_id: "a".into(),
                    }],
                ),
            ),
            (
                "apply_batch_idempotent",
                s.apply_batch_idempotent(
                    &w,
                    bad,
                    vec![TrayOp::Delete {
                        tray_ns: "t".into(),
                        tray_id: "a".into(),
                    }],
                    &IdempotencyKey::new("k").expect("key"),
                ),
            ),
            ("release", s.release(&w, bad)),
            (
                "list_trays",
                s.list_trays(&w, bad, &PageRequest::new(10)).map(drop),
            ),
            (
                "instance_trays",
                s.instance_trays(&w, bad, &TrayFilter::new()).map(drop),
            ),
            ("set_alarm", s.set_alarm(&w, bad, 5)),
            ("ack_alarm", s.ack_alarm(&w, bad, 5).map(drop)),
        ];
        for (call, r) in calls {
            match r {
                Err(StateError::Invalid { what }) => {
                    assert!(
                        what.contains(&bad.to_string()) && what.contains(&max.to_string()),
                        "{call}: {what}"
                    );
                }
                other => panic!("{call} at {bad}: {other:?}"),
            }
        }
        assert_eq!(s.epoch(&w).expect("epoch"), 3, "nothing moved");
        let t = s.read_tray(&w.tray("t", "a"), 3).expect("read").expect("a");
        assert_eq!((t.marked, t.doc.as_slice()), (true, &b"x"[..]));
    }
    s.write_tray(&w.tray("t", "a"), max, tray(false, b"z"))
        .expect("i64::MAX is an epoch");
    assert_eq!(s.epoch(&w).expect("epoch"), max);
}

/// pinned stores a caller's epoch as is, negative ones too: below every
/// epoch this store accepts, read as 0, and moved up by the store's first
/// call; fencing goes on working both ways.
#[test]
fn a_negative_stored_epoch_is_below_every_epoch() {
    let dsn = fresh_db("negepoch");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let mut c = raw(&dsn);
    pinned_set_tray(&mut c, "neg", "w", "t", "a", true, "{}", -5).expect("pinned at -5");
    pinned_set_tray(&mut c, "neg", "v", "t", "a", true, "{}", -5).expect("pinned at -5");
    let (w, v) = (InstanceKey::new("neg", "w"), InstanceKey::new("neg", "v"));
    assert_eq!(
        s.epoch(&w).expect("epoch"),
        0,
        "a negative epoch reads as 0"
    );
    let t = s.read_tray(&w.tray("t", "a"), 0).expect("read at 0");
    assert!(t.is_some());
    let stored: i64 = c
        .query_one(
            "SELECT epoch FROM pinned_epoch WHERE ns = 'neg' AND id = 'w'",
            &[],
        )
        .expect("q")
        .get(0);
    assert_eq!(stored, 0, "the store's call lifted it to its epoch");
    assert_eq!(
        pinned_set_tray(&mut c, "neg", "w", "t", "a", false, "{}", -3),
        Err(0),
        "pinned below the store's epoch is fenced"
    );
    // The locked path (list_trays) lifts it too.
    assert_eq!(list_all(&s, &v, 0, 10).len(), 1);
    let stored: i64 = c
        .query_one(
            "SELECT epoch FROM pinned_epoch WHERE ns = 'neg' AND id = 'v'",
            &[],
        )
        .expect("q")
        .get(0);
    assert_eq!(stored, 0);
    pinned_set_tray(&mut c, "neg", "v", "t", "a", false, "{}", 9).expect("pinned at 9");
    assert!(matches!(
        s.list_trays(&v, 8, &PageRequest::new(5)),
        Err(StateError::FenceLost {
            caller: 8,
            stored: 9,
            ..
        })
    ));
}

/// `setup()` refuses tables of pinned's names whose columns are not
/// pinned's, naming table, column, the type found and the type expected,
/// not retryable, and changes nothing.
#[test]
fn setup_refuses_a_mismatched_table() {
    let cases: &[(&str, &[&str])] = &[
        (
            "CREATE TABLE pinned_tray_index (ns TEXT NOT NULL, id TEXT NOT NULL, tray_ns TEXT NOT NULL, tray_id TEXT NOT NULL, marked BOOLEAN NOT NULL, doc TEXT NOT NULL, env TEXT NOT NULL DEFAULT '*', hostname TEXT NOT NULL DEFAULT '*', PRIMARY KEY (ns, id, tray_ns, tray_id))",
            &["pinned_tray_index", "doc", "text", "jsonb"],
        ),
        (
            "CREATE TABLE pinned_epoch (ns TEXT NOT NULL, id TEXT NOT NULL, epoch INTEGER NOT NULL, PRIMARY KEY (ns, id))",
            &["pinned_epoch", "epoch", "integer", "bigint"],
        ),
        (
            "CREATE TABLE pinned_epoch (ns TEXT NOT NULL, id TEXT NOT NULL, epoch NUMERIC(20, 0) NOT NULL, PRIMARY KEY (ns, id))",
            &["pinned_epoch", "epoch", "numeric(20,0)", "bigint"],
        ),
        (
            "CREATE TABLE pinned_epoch (ns TEXT NOT NULL, id TEXT NOT NULL, epoch BIGINT NOT NULL)",
            &["pinned_epoch", "primary key", "missing", "(ns, id)"],
        ),
        (
            "CREATE TABLE pinned_tray_index (ns TEXT NOT NULL, id TEXT NOT NULL, tray_ns TEXT NOT NULL, tray_id TEXT NOT NULL, marked BOOLEAN NOT NULL, doc JSONB NOT NULL, env TEXT NOT NULL DEFAULT '*', PRIMARY KEY (ns, id, tray_ns, tray_id))",
            &["pinned_tray_index", "hostname", "expected text"],
        ),
        (
            "CREATE TABLE pinned_tray_index (ns TEXT NOT NULL, id TEXT NOT NULL, tray_ns TEXT NOT NULL, tray_id TEXT NOT NULL, marked BOOLEAN NOT NULL, doc JSONB NOT NULL, env TEXT NOT NULL DEFAULT '*', hostname TEXT NOT NULL DEFAULT '*', doc_raw TEXT, PRIMARY KEY (ns, id, tray_ns, tray_id))",
            &["pinned_tray_index", "doc_raw", "text", "bytea"],
        ),
    ];
    for (ddl, words) in cases {
        let dsn = fresh_db("mismatch");
        let mut c = raw(&dsn);
        c.batch_execute(ddl).expect("another tool's table");
        let s = PostgresStore::connect(&dsn).expect("connect");
        let e = s.setup().expect_err("a mismatched table is refused");
        assert!(
            matches!(
                e,
                StateError::Persistence {
                    reason: PersistenceReason::Refused,
                    ..
                }
            ) && !e.is_retryable(),
            "{e:?}"
        );
        let msg = e.to_string();
        for w in *words {
            assert!(msg.contains(w), "{msg:?} names {w:?}");
        }
        assert_eq!(s.schema_version().expect("version"), None, "nothing set up");
    }
    // A statement the server cannot run as written (SQLSTATE class 42) is
    // not retryable either: here the column type changed under a set-up
    // store.
    let dsn = fresh_db("class42");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let mut c = raw(&dsn);
    c.batch_execute(
        "DROP TRIGGER agentstate_doc_raw ON pinned_tray_index; \
         ALTER TABLE pinned_tray_index ALTER COLUMN doc TYPE bytea \
         USING convert_to(doc::text, 'UTF8')",
    )
    .expect("another tool changes the type");
    let w = InstanceKey::new("c", "w");
    let e = s
        .write_tray(&w.tray("t", "a"), 1, tray(true, b"{}"))
        .expect_err("a type mismatch");
    assert!(!e.is_retryable(), "{e:?}");
    assert!(e.to_string().contains("42804"), "{e}");
}

/// `setup()` at the same moment as pinned's own setup, and as other
/// `setup()`s, in either order: every `setup()` succeeds, and the tables
/// end as pinned's.
#[test]
fn setup_races_pinned_setup() {
    for round in 0..6 {
        let dsn = fresh_db("race");
        let n = 4;
        let barrier = Arc::new(Barrier::new(n));
        let results: Vec<Result<(), String>> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..n)
                .map(|k| {
                    let (dsn, barrier) = (dsn.clone(), barrier.clone());
                    sc.spawn(move || -> Result<(), String> {
                        let pinned = (k + round) % 2 == 0;
                        let s = PostgresStore::connect(&dsn).expect("connect");
                        let mut c = raw(&dsn);
                        barrier.wait();
                        if pinned {
                            // pinned's own setup may lose the race with a
                            // unique violation (it does not retry); its
                            // tables are there either way afterwards.
                            let _ = c.batch_execute(&format!(
                                "BEGIN; {PINNED_EPOCH_DDL}; {PINNED_TRAY_DDL}; COMMIT"
                            ));
                            Ok(())
                        } else {
                            s.setup().map_err(|e| e.to_string())
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("thread"))
                .collect()
        });
        for r in results {
            r.expect("every setup succeeds");
        }
        let mut c = raw(&dsn);
        pinned_setup(&mut c);
        assert_pinned_shape(&mut c);
        let s = PostgresStore::connect(&dsn).expect("connect");
        assert_eq!(s.schema_version().expect("version"), Some(10));
    }
}

/// The schema files a database at `version` was set up with.
fn schema_files(version: usize) -> String {
    [
        include_str!("../../crates/postgres/src/schema/v1.sql"),
        include_str!("../../crates/postgres/src/schema/v2.sql"),
        include_str!("../../crates/postgres/src/schema/v3.sql"),
        include_str!("../../crates/postgres/src/schema/v4.sql"),
        include_str!("../../crates/postgres/src/schema/v5.sql"),
        include_str!("../../crates/postgres/src/schema/v6.sql"),
        include_str!("../../crates/postgres/src/schema/v7.sql"),
        include_str!("../../crates/postgres/src/schema/v8.sql"),
    ][..version]
        .concat()
        .replace("{s}", "public.")
}

/// A database an older build set up (schema 8: numeric epochs, bytea docs,
/// C collation), holding trays of every kind of doc, epochs and alarms,
/// is upgraded in place by `setup()`: docs read back byte for byte, SQL
/// sees them as JSON, alarm rows hold {"due_at": …}, the tables are
/// pinned's, and pinned works on them.
#[test]
fn setup_upgrades_a_schema_8_database() {
    let dsn = icu_db("up8");
    let mut c = raw(&dsn);
    c.batch_execute(&schema_files(8)).expect("schema 8");
    c.batch_execute(
        "INSERT INTO agentstate_meta VALUES ('schema_version', '8'), \
         ('cursor_secret', '00112233445566778899aabbccddeeff')",
    )
    .expect("meta");
    let docs: Vec<Vec<u8>> = vec![
        b"hello".to_vec(),
        br#"{ "b":1,"a" : 2}"#.to_vec(),
        br#"{"a": 2, "b": 1}"#.to_vec(),
        br#"{"a":"\u0000"}"#.to_vec(),
        vec![0xff, 0x00],
        b"1234".to_vec(),
    ];
    c.execute(
        "INSERT INTO pinned_epoch VALUES ('old', 'w', 7), ('old', 'big', 9223372036854775807)",
        &[],
    )
    .expect("epochs");
    for (i, d) in docs.iter().enumerate() {
        c.execute(
            "INSERT INTO pinned_tray_index VALUES ('old', 'w', 't', $1, $2, $3, 'prod', 'h')",
            &[&["B", "a", "c", "D", "e", "f"][i], &(i % 2 == 0), d],
        )
        .expect("a tray of schema 8");
    }
    c.execute(
        "INSERT INTO agentstate_alarms VALUES ('old', 'w', 1750000000000), ('old', 'x', 18446744073709551615)",
        &[],
    )
    .expect("alarms (their trigger writes their rows)");
    let s = PostgresStore::connect(&dsn).expect("connect");
    assert_eq!(s.schema_version().expect("version"), Some(8));
    std::thread::scope(|sc| {
        for _ in 0..3 {
            sc.spawn(|| {
                PostgresStore::connect(&dsn)
                    .expect("connect")
                    .setup()
                    .expect("upgrade")
            });
        }
    });
    assert_eq!(s.schema_version().expect("version"), Some(10));
    assert_pinned_shape(&mut c);
    let w = InstanceKey::new("old", "w");
    assert_eq!(s.epoch(&w).expect("epoch"), 7);
    assert_eq!(
        s.epoch(&InstanceKey::new("old", "big")).expect("epoch"),
        i64::MAX as u64
    );
    let listed = list_all(&s, &w, 7, 2);
    let ids: Vec<&str> = listed.iter().map(|(k, _)| k.tray_id.as_str()).collect();
    assert_eq!(ids, ["B", "D", "a", "c", "e", "f"], "byte order");
    for (i, d) in docs.iter().enumerate() {
        let id = ["B", "a", "c", "D", "e", "f"][i];
        let t = s.read_tray(&w.tray("t", id), 7).expect("read").expect(id);
        assert_eq!(&t.doc, d, "tray {id}: the exact old bytes");
        assert_eq!(t.marked, i % 2 == 0);
    }
    let as_sql: Vec<String> = c
        .query(
            "SELECT doc::text FROM pinned_tray_index WHERE ns = 'old' AND tray_ns = 't' ORDER BY tray_id COLLATE \"C\"",
            &[],
        )
        .expect("q")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        as_sql,
        [
            format!(r#"{{"agentstate:hex": "{}"}}"#, hex(b"hello")),
            format!(r#"{{"agentstate:hex": "{}"}}"#, hex(br#"{"a":"\u0000"}"#)),
            r#"{"a": 2, "b": 1}"#.to_string(),
            r#"{"a": 2, "b": 1}"#.to_string(),
            r#"{"agentstate:hex": "ff00"}"#.to_string(),
            "1234".to_string(),
        ]
    );
    let alarms: Vec<(String, String)> = c
        .query(
            "SELECT id, doc::text FROM pinned_tray_index WHERE tray_ns = 'pinned' \
             AND tray_id = 'alarm' AND marked ORDER BY id",
            &[],
        )
        .expect("alarm rows")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        alarms,
        [
            ("w".to_string(), r#"{"due_at": 1750000000000}"#.to_string()),
            (
                "x".to_string(),
                r#"{"due_at": 18446744073709551615}"#.to_string()
            ),
        ]
    );
    let due = s.due_alarms(u64::MAX, &PageRequest::new(10)).expect("due");
    assert_eq!(due.items().len(), 2);
    assert!(s.ack_alarm(&w, 7, 1_750_000_000_000).expect("ack"));
    s.set_alarm(&w, 7, 42).expect("set again");
    let doc: String = c
        .query_one(
            "SELECT doc::text FROM pinned_tray_index WHERE id = 'w' AND tray_id = 'alarm'",
            &[],
        )
        .expect("the alarm row")
        .get(0);
    assert_eq!(doc, r#"{"due_at": 42}"#);
    // pinned works on the upgraded tables.
    pinned_set_tray(&mut c, "old", "w", "t", "a", true, r#"{"p": 1}"#, 8).expect("pinned");
    let t = s.read_tray(&w.tray("t", "a"), 8).expect("read").expect("a");
    assert_eq!(t.doc, br#"{"p": 1}"#);
    let report = s.verify().expect("verify");
    assert!(report.is_ok(), "{:?}", report.problems);
}

/// An instance of a schema-8 database holding an epoch past i64::MAX
/// (schema 8 allowed any u64) stops the upgrade: `Refused`, naming the
/// instance, and the database is left at schema 8.
#[test]
fn setup_refuses_to_upgrade_an_epoch_past_i64_max() {
    let dsn = fresh_db("up8big");
    let mut c = raw(&dsn);
    c.batch_execute(&schema_files(8)).expect("schema 8");
    c.batch_execute(
        "INSERT INTO agentstate_meta VALUES ('schema_version', '8'), \
         ('cursor_secret', '00112233445566778899aabbccddeeff'); \
         INSERT INTO pinned_epoch VALUES ('ns1', 'too-big', 9223372036854775808), ('ns1', 'ok', 3)",
    )
    .expect("an epoch past i64::MAX");
    let s = PostgresStore::connect(&dsn).expect("connect");
    let e = s.setup().expect_err("refused");
    assert!(!e.is_retryable(), "{e:?}");
    let msg = e.to_string();
    for part in ["ns1", "too-big", "9223372036854775808", "i64::MAX"] {
        assert!(msg.contains(part), "{msg} names {part}");
    }
    assert_eq!(s.schema_version().expect("version"), Some(8), "untouched");
    let ty: String = c
        .query_one(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
             WHERE attrelid = 'pinned_epoch'::regclass AND attname = 'epoch'",
            &[],
        )
        .expect("q")
        .get(0);
    assert_eq!(ty, "numeric(20,0)");
}

/// Index scans of the listings: in a database ordered by ICU, a page of
/// `list_trays` or `marked_trays` reads about a page of index entries
/// (T5, L5: O(page)), not the table.
#[test]
fn listings_read_a_page_through_their_indexes() {
    let dsn = icu_db("explain");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let mut c = raw(&dsn);
    c.batch_execute(
        "INSERT INTO pinned_tray_index (ns, id, tray_ns, tray_id, marked, doc, env) \
         SELECT 'ix', 'i' || (n % 50), 't', 'k' || n, n % 3 = 0, '{}', 'e' || (n % 2) \
         FROM generate_series(1, 20000) n; ANALYZE pinned_tray_index",
    )
    .expect("rows");
    let reads = |c: &mut postgres::Client| -> Vec<(String, i64)> {
        c.query(
            "SELECT indexrelname::text, idx_tup_read FROM pg_stat_user_indexes \
             WHERE relname = 'pinned_tray_index' ORDER BY 1",
            &[],
        )
        .expect("stats")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
    };
    let i = InstanceKey::new("ix", "i7");
    for (what, call) in [
        ("pinned_tray_index_bytes", 0),
        ("pinned_tray_index_marked_bytes", 1),
        ("pinned_tray_index_marked_bytes_by_env", 2),
    ] {
        let before = reads(&mut c);
        let n = match call {
            0 => s
                .list_trays(&i, 1, &PageRequest::new(10))
                .expect("list")
                .items()
                .len(),
            1 => s
                .marked_trays(None, &PageRequest::new(10))
                .expect("marked")
                .items()
                .len(),
            _ => s
                .marked_trays(Some("e1"), &PageRequest::new(10))
                .expect("marked")
                .items()
                .len(),
        };
        assert_eq!(n, 10);
        // The store's connection reports its statistics when idle (within
        // about a second).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        let delta = loop {
            c.batch_execute("SELECT pg_stat_clear_snapshot()")
                .expect("clear");
            let after = reads(&mut c);
            let delta: Vec<(String, i64)> = after
                .iter()
                .zip(&before)
                .map(|((n, a), (_, b))| (n.clone(), a - b))
                .filter(|(_, d)| *d > 0)
                .collect();
            if !delta.is_empty() || std::time::Instant::now() > deadline {
                break delta;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        let used: Vec<&str> = delta.iter().map(|(n, _)| n.as_str()).collect();
        assert!(used.contains(&what), "{what}: {delta:?}");
        let read: i64 = delta.iter().map(|(_, d)| d).sum();
        assert!(read <= 40, "{what}: a page reads about a page: {delta:?}");
    }
}

/// What the listings return for pinned's ids is what a point read finds,
/// and the sweeper's walk visits each marked tray once, in byte order,
/// while pinned and the store write in the same tables.
#[test]
fn marked_trays_walks_rows_of_both_writers_in_byte_order() {
    let dsn = icu_db("walk");
    let s = PostgresStore::connect(&dsn).expect("connect");
    let mut c = raw(&dsn);
    pinned_setup(&mut c);
    s.setup().expect("setup");
    let mut want = Vec::new();
    for (k, id) in ["b", "A", "a", "B", "é", "Z"].iter().enumerate() {
        if k % 2 == 0 {
            pinned_set_tray(&mut c, "walk", id, "t", "x", true, "{}", 1).expect("pinned");
        } else {
            s.write_tray(
                &InstanceKey::new("walk", *id).tray("t", "x"),
                1,
                tray(true, b"{}"),
            )
            .expect("store");
        }
        want.push(id.to_string());
    }
    want.sort();
    let got: Vec<String> = marked_all(&s, None, 2)
        .into_iter()
        .filter(|k| k.ns == "walk")
        .map(|k| k.id)
        .collect();
    assert_eq!(got, want, "byte order, each once");
    for id in &want {
        let t = s
            .read_tray(&InstanceKey::new("walk", id).tray("t", "x"), 1)
            .expect("read");
        assert!(t.is_some(), "{id}");
    }
}

/// T7 on rows pinned wrote, in a database ordered by ICU: every tray of
/// the instance in byte order, the filters applied, the alarm row left
/// out, fenced like every tray call.
#[test]
fn instance_trays_reads_pinned_rows_in_byte_order() {
    let dsn = icu_db("t7");
    let mut c = raw(&dsn);
    pinned_setup(&mut c);
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let w = InstanceKey::new("t7", "w");
    for (tns, tid, marked) in [
        ("x", "b", true),
        ("x", "A", false),
        ("Y", "a", true),
        ("x", "a", true),
    ] {
        pinned_set_tray(&mut c, "t7", "w", tns, tid, marked, r#"{"k": 1}"#, 2).expect("pinned");
    }
    s.write_tray(&w.tray("x", "B"), 2, tray(false, b"raw bytes"))
        .expect("the store's own");
    s.set_alarm(&w, 2, 99).expect("an alarm");
    let keys = |f: &TrayFilter| -> Vec<(String, String)> {
        s.instance_trays(&w, 2, f)
            .expect("instance_trays")
            .into_iter()
            .map(|(k, _)| (k.tray_ns, k.tray_id))
            .collect()
    };
    let p = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        keys(&TrayFilter::new()),
        [
            p("Y", "a"),
            p("x", "A"),
            p("x", "B"),
            p("x", "a"),
            p("x", "b")
        ]
    );
    assert_eq!(
        keys(&TrayFilter::new().tray_ns("x")),
        [p("x", "A"), p("x", "B"), p("x", "a"), p("x", "b")]
    );
    assert_eq!(
        keys(&TrayFilter::new().marked(true)),
        [p("Y", "a"), p("x", "a"), p("x", "b")]
    );
    assert_eq!(
        keys(&TrayFilter::new().tray_ns("x").marked(false)),
        [p("x", "A"), p("x", "B")]
    );
    let all = s.instance_trays(&w, 2, &TrayFilter::new()).expect("all");
    let docs: Vec<&[u8]> = all.iter().map(|(_, t)| t.doc.as_slice()).collect();
    assert_eq!(docs[2], b"raw bytes");
    assert_eq!(docs[0], br#"{"k": 1}"#);
    assert!(
        s.instance_trays(&InstanceKey::new("t7", "none"), 0, &TrayFilter::new())
            .expect("no trays")
            .is_empty()
    );
    let e = s
        .instance_trays(&w, 1, &TrayFilter::new())
        .expect_err("stale");
    assert!(
        matches!(
            e,
            StateError::FenceLost {
                caller: 1,
                stored: 2,
                ..
            }
        ),
        "{e:?}"
    );
    s.instance_trays(&w, 3, &TrayFilter::new())
        .expect("a newer holder");
    assert_eq!(
        pinned_set_tray(&mut c, "t7", "w", "x", "b", false, "{}", 2),
        Err(3),
        "instance_trays at 3 fenced pinned at 2"
    );
}
