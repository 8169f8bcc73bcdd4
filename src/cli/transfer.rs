//! `export` and `import`: a store as JSON Lines.
//!
//! # Export format, version 2
//!
//! UTF-8 text, one JSON value per line, each line ending in `\n`:
//!
//! 1. A header: exactly `{"agentstate_export":2}`. The number is the format
//!    version; an importer refuses a version it does not know. Version 1
//!    (before spend caps: no `caps`/`budget` on runs, no `hold` or `budget`
//!    lines) is read too: its runs have no caps.
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
//!
//! Times are unix milliseconds. Versions, `seq`s and timestamps are kept,
//! so export → import → export gives the same bytes. A later format that
//! changes or adds fields gets a new version number, and this reader
//! refuses a version it does not know.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use agentstate::{Entry, StateError, Store};

use super::CliError;
use super::output::{Progress, thousands};

/// The format version this build writes (and the newest it reads).
pub const EXPORT_FORMAT_VERSION: u64 = 2;
/// The oldest format version this build reads.
pub const EXPORT_FORMAT_OLDEST: u64 = 1;
/// Entries per export page.
const EXPORT_PAGE: usize = 1000;

fn header() -> String {
    format!("{{\"agentstate_export\":{EXPORT_FORMAT_VERSION}}}")
}

/// Writes the whole store to `w`; returns the entries written.
fn write_all(store: &dyn Store, w: &mut dyn Write) -> Result<u64, CliError> {
    writeln!(w, "{}", header())?;
    let mut progress = Progress::new("entries exported");
    let mut n = 0u64;
    for e in store.iter_export().page_size(EXPORT_PAGE) {
        serde_json::to_writer(&mut *w, &e?)
            .map_err(|e| CliError::io(format!("writing the export: {e}")))?;
        w.write_all(b"\n")?;
        n += 1;
        progress.inc(1);
    }
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

/// `import`: from `file` or stdin into the (empty) store `db`.
pub fn import(
    store: &dyn Store,
    db: &str,
    file: Option<&Path>,
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
    let reader: Box<dyn BufRead> = match file {
        Some(p) => {
            Box::new(BufReader::new(File::open(p).map_err(|e| {
                CliError::usage(format!("opening {}: {e}", p.display()))
            })?))
        }
        None => Box::new(BufReader::new(std::io::stdin().lock())),
    };
    let mut lines = reader.lines();
    let read_err = |e: std::io::Error| CliError::usage(format!("reading {source}: {e}"));
    let first = lines.next().transpose().map_err(read_err)?.ok_or_else(|| {
        CliError::usage(format!("{source} is empty; expected an agentstate export"))
    })?;
    check_header(&first, &source)?;
    let mut progress = Progress::new("entries imported");
    // The line being read, for the error message; a bad line stops the
    // import (the store's `import` returns the iterator's error).
    let lineno = std::cell::Cell::new(1usize);
    let mut bad_line: Option<CliError> = None;
    let mut entries = lines
        .inspect(|_| lineno.set(lineno.get() + 1))
        .filter(|line| !matches!(line, Ok(l) if l.trim().is_empty()))
        .map(|line| {
            let parsed = match line {
                Err(e) => Err(read_err(e)),
                Ok(line) => serde_json::from_str::<Entry>(&line).map_err(|e| {
                    CliError::usage(format!(
                        "{source} line {}: not an export entry ({e})",
                        lineno.get()
                    ))
                }),
            };
            match parsed {
                Ok(entry) => {
                    progress.inc(1);
                    Ok(entry)
                }
                Err(e) => {
                    let what = e.message.clone();
                    bad_line = Some(e);
                    Err(StateError::Invalid { what })
                }
            }
        });
    let result = store.import(&mut entries);
    drop(entries);
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
        (Err(e), None) => Err(CliError::usage(format!(
            "{source}, at line {}: {e}; {partial}",
            lineno.get()
        ))),
    }
}

fn check_header(line: &str, source: &str) -> Result<(), CliError> {
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
    Ok(())
}
