//! `export` and `import`: a store as JSON Lines.
//!
//! # Export format, version 2
//!
//! UTF-8 text, one JSON value per line, each line ending in `\n`:
//!
//! 1. A header: exactly `{"agentstate_export":2}`. The number is the format
//!    version; an importer refuses a version it does not know. Version 1
//!    (before spend caps and the trailer: no `caps`/`budget` on runs, no
//!    `hold` or `budget` lines, no trailer) is read too: its runs have no
//!    caps.
//! 2. One line per record, in the store's deterministic export order (runs,
//!    then holds, sessions, budgets, epochs, trays, alarms; each in key
//!    order). Each line is
//!    an `agentstate::Entry` as serde_json writes it: an object whose `kind`
//!    is one of
//!    - `run`: the `RunRecord` fields (`key {tenant, run_id}`, `version`,
//!      `state`, `agent_name`, `session_id`, `messages_read`,
//!      `pending_tool_calls [{id, name, arguments}]`, `usage {input_tokens,
//!      output_tokens}`, `cost_micros`, `iterations`, `approval {id,
//!      prompt}`, `created_at`, `updated_at`, `seq`, `caps {cost_micros_max,
//!      tokens_max, iterations_max}` (each a number or null), `budget`);
//!    - `hold`: `run {tenant, run_id}`, `hold {id, amounts {cost_micros,
//!      tokens, iterations}, created_at, expires_at}`;
//!    - `session`: the `SessionRecord` fields (`key {tenant, session_id}`,
//!      `version`, `metadata {…}`, `created_at`, `updated_at`);
//!    - `budget`: `budget {key {tenant, name}, version, caps {…},
//!      created_at, updated_at}`, `spent {cost_micros, tokens, iterations}`;
//!    - `epoch`: `instance {ns, id}`, `epoch`;
//!    - `tray`: `key {ns, id, tray_ns, tray_id}`, `tray {marked, doc, env,
//!      hostname}` with `doc` as an array of byte values;
//!    - `alarm`: `instance {ns, id}`, `due_at`.
//! 3. A trailer, the last line:
//!    `{"agentstate_export_end":{"entries":N,"sha256":"HEX"}}` — `N` the
//!    number of entry lines, `HEX` the lower-case SHA-256 of every byte
//!    before the trailer (header and entry lines, newlines included).
//!
//! Times are unix milliseconds. Versions, `seq`s and timestamps are kept,
//! so export → import → export gives the same bytes.
//!
//! `import` checks the trailer before anything becomes visible: the store's
//! import is all or nothing, and a missing, wrong or misplaced trailer fails
//! it. A format-2 file without a trailer (cut short, say) is refused unless
//! `--allow-untrailed` is given. Files of format 1 (no trailer) still
//! import, with a warning that a cut-short file cannot be noticed.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use agentstate::{Entry, StateError, Store};
use sha2::{Digest, Sha256};

use super::CliError;
use super::output::{Progress, thousands};

/// The format version this build writes (and the newest it reads).
pub const EXPORT_FORMAT_VERSION: u64 = 2;
/// The oldest format version this build reads.
pub const EXPORT_FORMAT_OLDEST: u64 = 1;
/// The key of the trailer line's object.
const TRAILER_KEY: &str = "agentstate_export_end";
/// Entries per export page.
const EXPORT_PAGE: usize = 1000;

fn header() -> String {
    format!("{{\"agentstate_export\":{EXPORT_FORMAT_VERSION}}}")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The trailer line (without its newline) for `entries` lines hashed so far.
fn trailer(entries: u64, sha: Sha256) -> String {
    format!(
        "{{\"{TRAILER_KEY}\":{{\"entries\":{entries},\"sha256\":\"{}\"}}}}",
        hex(&sha.finalize())
    )
}

/// Writes the whole store to `w`, trailer last; returns the entries written.
fn write_all(store: &dyn Store, w: &mut dyn Write) -> Result<u64, CliError> {
    let mut sha = Sha256::new();
    let mut line = format!("{}\n", header()).into_bytes();
    w.write_all(&line)?;
    sha.update(&line);
    let mut progress = Progress::new("entries exported");
    let mut n = 0u64;
    for e in store.iter_export().page_size(EXPORT_PAGE) {
        line.clear();
        serde_json::to_writer(&mut line, &e?)
            .map_err(|e| CliError::io(format!("writing the export: {e}")))?;
        line.push(b'\n');
        w.write_all(&line)?;
        sha.update(&line);
        n += 1;
        progress.inc(1);
    }
    writeln!(w, "{}", trailer(n, sha))?;
    progress.finish();
    Ok(n)
}

/// `export`: to `file` (written beside it, then renamed into place) or stdout.
pub fn export(store: &dyn Store, file: Option<&Path>, out: &mut dyn Write) -> Result<(), CliError> {
    let Some(path) = file else {
        write_all(store, out)?;
        return Ok(());
    };
    let name = path
        .file_name()
        .ok_or_else(|| CliError::usage(format!("--out {} is not a file name", path.display())))?;
    let tmp = path.with_file_name(format!(".{}.partial", name.to_string_lossy()));
    let fail =
        |what: &str, e: std::io::Error| CliError::usage(format!("{what} {}: {e}", tmp.display()));
    let f = File::create(&tmp).map_err(|e| fail("creating", e))?;
    let mut w = BufWriter::new(f);
    let written = write_all(store, &mut w).and_then(|n| {
        let f = w
            .into_inner()
            .map_err(|e| fail("writing", e.into_error()))?;
        f.sync_all().map_err(|e| fail("syncing", e))?;
        Ok(n)
    });
    let n = match written {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    std::fs::rename(&tmp, path)
        .map_err(|e| CliError::usage(format!("moving the export to {}: {e}", path.display())))?;
    eprintln!("exported {} entries to {}", thousands(n), path.display());
    Ok(())
}

/// Where an import's reader stands with the trailer.
struct TrailerCheck {
    version: u64,
    sha: Sha256,
    entries: u64,
    /// The trailer's line number and what it says, once read.
    seen: Option<(usize, u64, String)>,
}

/// `import`: from `file` or stdin into the (empty) store `db`. All or
/// nothing: the store's import writes nothing visible unless every line,
/// and the trailer, checks out.
pub fn import(
    store: &dyn Store,
    db: &str,
    file: Option<&Path>,
    allow_untrailed: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    if !store.is_empty()? {
        return Err(CliError::usage(format!(
            "store {db} is not empty; import only into an empty store (pick a new --db path)"
        )));
    }
    let source = file
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "stdin".into());
    let mut reader: Box<dyn BufRead> = match file {
        Some(p) => {
            Box::new(BufReader::new(File::open(p).map_err(|e| {
                CliError::usage(format!("opening {}: {e}", p.display()))
            })?))
        }
        None => Box::new(BufReader::new(std::io::stdin().lock())),
    };
    let read_err = |e: std::io::Error| CliError::usage(format!("reading {source}: {e}"));
    let mut first = String::new();
    if reader.read_line(&mut first).map_err(read_err)? == 0 {
        return Err(CliError::usage(format!(
            "{source} is empty; expected an agentstate export"
        )));
    }
    let version = check_header(first.trim_end_matches(['\n', '\r']), &source)?;
    if version == 1 {
        eprintln!(
            "warning: {source} is export format 1, which has no trailer: a file cut short cannot be noticed"
        );
    }
    let mut check = TrailerCheck {
        version,
        sha: Sha256::new(),
        entries: 0,
        seen: None,
    };
    check.sha.update(first.as_bytes());
    let mut progress = Progress::new("entries imported");
    // The line being read, for the error message; a bad line stops the
    // import (the store's `import` returns the iterator's error).
    let mut lineno = 1usize;
    let mut bad_line: Option<CliError> = None;
    let mut finished = false;
    let mut next = || -> Option<Result<Entry, CliError>> {
        loop {
            let mut raw = String::new();
            match reader.read_line(&mut raw) {
                Err(e) => return Some(Err(read_err(e))),
                Ok(0) => return check_end(&check, allow_untrailed, &source).err().map(Err),
                Ok(_) => {}
            }
            lineno += 1;
            let line = raw.trim_end_matches(['\n', '\r']);
            if let Some((at, ..)) = &check.seen {
                if line.trim().is_empty() {
                    continue;
                }
                return Some(Err(CliError::usage(format!(
                    "{source} line {lineno}: data after the trailer on line {at}"
                ))));
            }
            if check.version >= 2 && line.starts_with(&format!("{{\"{TRAILER_KEY}\"")) {
                match parse_trailer(line) {
                    Some((n, sha)) => check.seen = Some((lineno, n, sha)),
                    None => {
                        return Some(Err(CliError::usage(format!(
                            "{source} line {lineno}: a damaged trailer"
                        ))));
                    }
                }
                continue;
            }
            check.sha.update(raw.as_bytes());
            if line.trim().is_empty() {
                continue;
            }
            check.entries += 1;
            // Each entry is checked here, at its own line; the store checks
            // it again (and what depends on other entries) a group later.
            return Some(
                serde_json::from_str::<Entry>(line)
                    .map_err(|e| {
                        CliError::usage(format!(
                            "{source} line {lineno}: not an export entry ({e})"
                        ))
                    })
                    .and_then(|entry| {
                        entry
                            .check()
                            .map_err(|e| CliError::usage(format!("{source} line {lineno}: {e}")))?;
                        Ok(entry)
                    }),
            );
        }
    };
    let mut entries = std::iter::from_fn(|| {
        if finished {
            return None;
        }
        match next() {
            None => {
                finished = true;
                None
            }
            Some(Ok(entry)) => {
                progress.inc(1);
                Some(Ok(entry))
            }
            Some(Err(e)) => {
                finished = true;
                let what = e.message.clone();
                bad_line = Some(e);
                Some(Err(StateError::Invalid { what }))
            }
        }
    });
    let result = store.import(&mut entries);
    progress.finish();
    let partial = match store.is_empty() {
        Ok(true) => "nothing was imported".to_string(),
        _ => format!("some entries were imported: delete {db} and import again once fixed"),
    };
    match (result, bad_line) {
        (Ok(n), _) => {
            writeln!(
                out,
                "imported {} entries from {source} into {db}",
                thousands(n)
            )?;
            Ok(())
        }
        (Err(_), Some(e)) => Err(CliError::usage(format!("{}; {partial}", e.message))),
        // The store's own refusal (a record or seq given twice, a doc past
        // its limit) comes a group after the line that caused it: it names
        // the record, not a line.
        (Err(e), None) => Err(CliError::usage(format!("{source}: {e}; {partial}"))),
    }
}

/// `{"agentstate_export_end":{"entries":N,"sha256":"HEX"}}` → (N, HEX).
fn parse_trailer(line: &str) -> Option<(u64, String)> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let obj = v.as_object()?;
    if obj.len() != 1 {
        return None;
    }
    let t = obj.get(TRAILER_KEY)?.as_object()?;
    let n = t.get("entries")?.as_u64()?;
    let sha = t.get("sha256")?.as_str()?;
    (t.len() == 2 && sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| (n, sha.to_ascii_lowercase()))
}

/// At the end of the file: the trailer was there and matches what was
/// read (format 2), or its absence is allowed.
fn check_end(check: &TrailerCheck, allow_untrailed: bool, source: &str) -> Result<(), CliError> {
    if check.version < 2 {
        return Ok(());
    }
    match &check.seen {
        None if allow_untrailed => {
            eprintln!(
                "warning: {source} has no trailer (--allow-untrailed): it may have been cut short"
            );
            Ok(())
        }
        None => Err(CliError::usage(format!(
            "{source} ends without its trailer line after {} entries: the file was cut short \
             (or not written by agentstate export); --allow-untrailed imports it anyway",
            thousands(check.entries)
        ))),
        Some((at, n, sha)) => {
            let got = hex(&check.sha.clone().finalize());
            if *n != check.entries {
                Err(CliError::usage(format!(
                    "{source}: the trailer on line {at} counts {} entries but the file holds {}",
                    thousands(*n),
                    thousands(check.entries)
                )))
            } else if *sha != got {
                Err(CliError::usage(format!(
                    "{source}: the checksum in the trailer on line {at} does not match the file (it was altered)"
                )))
            } else {
                Ok(())
            }
        }
    }
}

/// Checks the header line; returns the format version (1 or 2).
fn check_header(line: &str, source: &str) -> Result<u64, CliError> {
    let not_export = || {
        CliError::usage(format!(
            "{source} is not an agentstate export (its first line is not {})",
            header()
        ))
    };
    let v: serde_json::Value = serde_json::from_str(line).map_err(|_| not_export())?;
    let version = v
        .get("agentstate_export")
        .and_then(|n| n.as_u64())
        .ok_or_else(not_export)?;
    if !(EXPORT_FORMAT_OLDEST..=EXPORT_FORMAT_VERSION).contains(&version) {
        return Err(CliError::usage(format!(
            "{source} is export format {version}; this agentstate reads formats {EXPORT_FORMAT_OLDEST} to {EXPORT_FORMAT_VERSION} (use a matching release)"
        )));
    }
    Ok(version)
}
