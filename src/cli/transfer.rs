//! `export` and `import`: a store as JSON Lines.
//!
//! # Export format, version 1
//!
//! UTF-8 text, one JSON value per line, each line ending in `\n`:
//!
//! 1. A header: exactly `{"agentstate_export":1}`. The number is the format
//!    version; an importer refuses a version it does not know.
//! 2. One line per record, in the store's deterministic export order (runs,
//!    then sessions, epochs, trays, alarms; each in key order). Each line is
//!    an `agentstate::Entry` as serde_json writes it: an object whose `kind`
//!    is one of
//!    - `run`: the `RunRecord` fields (`key {tenant, run_id}`, `version`,
//!      `state`, `agent_name`, `session_id`, `messages_read`,
//!      `pending_tool_calls [{id, name, arguments}]`, `usage {input_tokens,
//!      output_tokens}`, `cost_micros`, `iterations`, `approval {id,
//!      prompt}`, `created_at`, `updated_at`, `seq`);
//!    - `session`: the `SessionRecord` fields (`key {tenant, session_id}`,
//!      `version`, `metadata {…}`, `created_at`, `updated_at`);
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

use agentstate::{Entry, Store};

use super::CliError;
use super::output::{Progress, thousands};

/// The format version this build writes and reads.
pub const EXPORT_FORMAT_VERSION: u64 = 1;
/// Entries per `Store::import` call: one atomic group each.
const IMPORT_BATCH: usize = 1000;
/// Entries per export page.
const EXPORT_PAGE: usize = 1000;

fn header() -> String {
    format!("{{\"agentstate_export\":{EXPORT_FORMAT_VERSION}}}")
}

/// Writes the whole store to `w`; returns the entries written.
fn write_all(store: &Store, w: &mut dyn Write) -> Result<u64, CliError> {
    writeln!(w, "{}", header())?;
    let mut progress = Progress::new("entries exported");
    let mut cursor = None;
    let mut n = 0u64;
    loop {
        let (items, next) = store
            .export_page(EXPORT_PAGE, cursor.as_ref())?
            .into_parts();
        for e in &items {
            serde_json::to_writer(&mut *w, e)
                .map_err(|e| CliError::io(format!("writing the export: {e}")))?;
            w.write_all(b"\n")?;
        }
        n += items.len() as u64;
        progress.inc(items.len() as u64);
        match next {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    progress.finish();
    Ok(n)
}

/// `export`: to `file` (written beside it, then renamed into place) or stdout.
pub fn export(store: &Store, file: Option<&Path>, out: &mut dyn Write) -> Result<(), CliError> {
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

/// `import`: from `file` or stdin into the (empty) store.
pub fn import(store: &Store, file: Option<&Path>, out: &mut dyn Write) -> Result<(), CliError> {
    let db = store
        .path()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
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
    let mut batch = Vec::with_capacity(IMPORT_BATCH);
    let mut imported = 0u64;
    // Batches commit as they fill: a failure leaves the batches before it.
    let partial = |imported: u64| {
        if imported == 0 {
            "nothing was imported".to_string()
        } else {
            format!(
                "the first {} entries were imported; delete {db} and import again once fixed",
                thousands(imported)
            )
        }
    };
    for (i, line) in lines.enumerate() {
        let lineno = i + 2;
        let line = line.map_err(read_err)?;
        if line.trim().is_empty() {
            continue;
        }
        let entry: Entry = serde_json::from_str(&line).map_err(|e| {
            CliError::usage(format!(
                "{source} line {lineno}: not an export entry ({e}); {}",
                partial(imported)
            ))
        })?;
        batch.push(entry);
        if batch.len() == IMPORT_BATCH {
            let n = batch.len() as u64;
            store.import(std::mem::take(&mut batch)).map_err(|e| {
                CliError::usage(format!(
                    "{source}, entries before line {}: {e}; {}",
                    lineno + 1,
                    partial(imported)
                ))
            })?;
            imported += n;
            progress.inc(n);
        }
    }
    if !batch.is_empty() {
        let n = batch.len() as u64;
        store.import(batch).map_err(|e| {
            CliError::usage(format!(
                "{source}, last entries: {e}; {}",
                partial(imported)
            ))
        })?;
        imported += n;
        progress.inc(n);
    }
    progress.finish();
    writeln!(
        out,
        "imported {} entries from {source} into {db}",
        thousands(imported)
    )?;
    Ok(())
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
    if version != EXPORT_FORMAT_VERSION {
        return Err(CliError::usage(format!(
            "{source} is export format {version}; this agentstate reads format {EXPORT_FORMAT_VERSION} (use a matching release)"
        )));
    }
    Ok(())
}
