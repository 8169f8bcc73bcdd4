//! `copy --from SRC --to DST`: a whole store into an empty one, between any
//! two backends, then a comparison of counts and per-record checksums.

use std::collections::BTreeMap;
use std::hash::Hasher;
use std::io::Write;

use agentstate::{Entry, Store};

use super::CliError;
use super::open::{Connect, DbSpec, Open, open};
use super::output::{Progress, thousands};

/// Entries read per page of the source.
const PAGE: usize = 1000;

/// Per kind of entry: how many, and the sum of their checksums (a multiset
/// hash: equal when both stores hold the same records, whatever order they
/// list them in).
type Tally = BTreeMap<&'static str, (u64, u64)>;

fn kind(e: &Entry) -> &'static str {
    match e {
        Entry::Run(_) => "runs",
        Entry::Session(_) => "sessions",
        Entry::Hold { .. } => "holds",
        Entry::Budget { .. } => "budgets",
        Entry::Epoch { .. } => "epochs",
        Entry::Tray { .. } => "trays",
        Entry::Alarm { .. } => "alarms",
    }
}

/// A 64-bit checksum of an entry's export form (every field).
fn checksum(e: &Entry) -> Result<u64, CliError> {
    let bytes = serde_json::to_vec(e).map_err(|e| CliError::io(format!("encoding: {e}")))?;
    let mut h =
        siphasher::sip::SipHasher13::new_with_keys(0x6167_656e_7473_7461, 0x0074_6520_636f_7079);
    h.write(&bytes);
    Ok(h.finish())
}

fn count(t: &mut Tally, e: &Entry) -> Result<(), CliError> {
    let sum = checksum(e)?;
    let slot = t.entry(kind(e)).or_default();
    slot.0 += 1;
    slot.1 = slot.1.wrapping_add(sum);
    Ok(())
}

/// Walks a whole store and tallies it.
fn tally(store: &dyn Store, what: &str) -> Result<Tally, CliError> {
    let mut t = Tally::new();
    let mut progress = Progress::new(what);
    for e in store.iter_export().page_size(PAGE) {
        count(&mut t, &e?)?;
        progress.inc(1);
    }
    progress.finish();
    Ok(t)
}

pub fn run(
    from: &DbSpec,
    to: &DbSpec,
    conn: &Connect,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    if from == to {
        return Err(CliError::usage("copy: --from and --to name the same store"));
    }
    let src = open(from, conn, Open::Existing)?;
    let dst = open(to, conn, Open::Create)?;
    if !dst.is_empty()? {
        return Err(CliError::usage(format!(
            "copy: {} is not empty; copy only into an empty store",
            to.display()
        )));
    }
    let mut copied = Tally::new();
    let mut progress = Progress::new("entries copied");
    let mut failed: Option<CliError> = None;
    let mut entries = src.iter_export().page_size(PAGE).inspect(|e| {
        if let Ok(e) = e {
            if let Err(err) = count(&mut copied, e) {
                failed = Some(err);
            }
            progress.inc(1);
        }
    });
    let n = dst.import(&mut entries).map_err(|e| {
        CliError::usage(format!(
            "copy into {}: {e}; entries before the failure may be there: empty it before copying again",
            to.display()
        ))
    })?;
    drop(entries);
    progress.finish();
    if let Some(e) = failed {
        return Err(e);
    }
    writeln!(
        out,
        "copied {} entries from {} to {}",
        thousands(n),
        from.display(),
        to.display()
    )?;
    let target = tally(&*dst, "entries compared")?;
    let mut ok = true;
    for k in ["runs", "sessions", "epochs", "trays", "alarms"] {
        let (a, b) = (
            copied.get(k).copied().unwrap_or_default(),
            target.get(k).copied().unwrap_or_default(),
        );
        let verdict = if a == b {
            "match"
        } else {
            ok = false;
            "DIFFER"
        };
        writeln!(
            out,
            "  {k:<9} {:>12} read, {:>12} in the copy: counts and checksums {verdict}",
            thousands(a.0),
            thousands(b.0)
        )?;
    }
    if !ok {
        return Err(CliError::failed(format!(
            "copy: {} does not hold what was read from {}",
            to.display(),
            from.display()
        )));
    }
    writeln!(
        out,
        "verified: the copy holds every record, checksums equal"
    )?;
    Ok(())
}
