//! TIME arguments and how times are shown.
//!
//! A TIME is one of:
//! - `now`;
//! - unix milliseconds: `1796040000000`;
//! - a duration ago: `45s`, `10m`, `2h`, `3d`, `1w`, `500ms`, or several
//!   together (`1h30m`);
//! - an RFC 3339-ish date and time: `2026-11-30T12:00:00Z`,
//!   `2026-11-30 12:00`, `2026-11-30T12:00:00.250+01:00`, `2026-11-30`
//!   (midnight). A time without a zone is UTC.

use agentstate::Millis;

const MS_PER_DAY: i64 = 86_400_000;

/// The system clock, in unix milliseconds.
pub fn now_millis() -> Millis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Parses a TIME against the system clock (clap's value parser).
pub fn parse_time(s: &str) -> Result<Millis, String> {
    parse_time_at(s, now_millis())
}

/// Parses a TIME, reading durations as "that long before `now`".
pub fn parse_time_at(s: &str, now: Millis) -> Result<Millis, String> {
    let s = s.trim();
    let expected = "expected `now`, unix millis (1796040000000), a duration ago (45s, 10m, 2h, 3d) or a date and time (2026-11-30T12:00:00Z)";
    if s.is_empty() {
        return Err(format!("empty time; {expected}"));
    }
    if s == "now" {
        return Ok(now);
    }
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return s
            .parse()
            .map_err(|_| format!("{s:?} is too large for unix millis"));
    }
    if s.as_bytes()[0].is_ascii_digit()
        && s.as_bytes()[s.len() - 1].is_ascii_alphabetic()
        && !s.contains('-')
    {
        let ago = parse_duration(s)
            .ok_or_else(|| format!("{s:?} is not a duration like 45s, 10m, 2h, 3d, 1h30m"))?;
        return now
            .checked_sub(ago)
            .ok_or_else(|| format!("{s:?} ago is before 1970"));
    }
    parse_datetime(s).ok_or_else(|| format!("{s:?} is not a time; {expected}"))
}

/// `45s`, `10m`, `1h30m`, `500ms` → milliseconds.
fn parse_duration(s: &str) -> Option<u64> {
    let mut total: u64 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let n: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let letters = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit: u64 = match &rest[..letters] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => MS_PER_DAY as u64,
            "w" => 7 * MS_PER_DAY as u64,
            _ => return None,
        };
        rest = &rest[letters..];
        total = total.checked_add(n.checked_mul(unit)?)?;
    }
    Some(total)
}

/// `YYYY-MM-DD[(T| )HH:MM[:SS[.fff]]][Z|±HH:MM]` → unix millis.
fn parse_datetime(s: &str) -> Option<Millis> {
    let b = s.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let part = s.get(from..from + len)?;
        part.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| part.parse().ok())?
    };
    let year = num(0, 4)?;
    if b.get(4) != Some(&b'-') || b.get(7) != Some(&b'-') {
        return None;
    }
    let (month, day) = (num(5, 2)?, num(8, 2)?);
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return None;
    }
    let mut ms = days_from_civil(year, month, day) * MS_PER_DAY;
    let mut i = 10;
    if i < b.len() && (b[i] == b'T' || b[i] == b't' || b[i] == b' ') {
        let (h, m) = (num(i + 1, 2)?, num(i + 4, 2)?);
        if b.get(i + 3) != Some(&b':') || h > 23 || m > 59 {
            return None;
        }
        ms += (h * 3600 + m * 60) * 1000;
        i += 6;
        if b.get(i) == Some(&b':') {
            let sec = num(i + 1, 2)?;
            if sec > 60 {
                return None;
            }
            ms += sec * 1000;
            i += 3;
            if b.get(i) == Some(&b'.') {
                let digits = b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
                if digits == 0 {
                    return None;
                }
                // Milliseconds: the first three digits, padded.
                let frac = &s[i + 1..i + 1 + digits.min(3)];
                let frac: i64 = frac.parse().ok()?;
                ms += frac * 10_i64.pow(3 - digits.min(3) as u32);
                i += 1 + digits;
            }
        }
    }
    match b.get(i) {
        None => {}
        Some(b'Z' | b'z') if i + 1 == b.len() => {}
        Some(&sign @ (b'+' | b'-')) if b.len() == i + 6 && b[i + 3] == b':' => {
            let (h, m) = (num(i + 1, 2)?, num(i + 4, 2)?);
            if h > 23 || m > 59 {
                return None;
            }
            let offset = (h * 60 + m) * 60_000;
            // 12:00+01:00 is 11:00Z.
            ms += if sign == b'+' { -offset } else { offset };
        }
        _ => return None,
    }
    u64::try_from(ms).ok()
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day since 1970-01-01 (`civil_from_days`).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Unix millis as `2026-11-30T12:00:00Z` (milliseconds shown when not 0).
pub fn format_time(ms: Millis) -> String {
    let ms = ms as i64;
    let (days, rem) = (ms.div_euclid(MS_PER_DAY), ms.rem_euclid(MS_PER_DAY));
    let (y, mo, d) = civil_from_days(days);
    let (h, mi, s, frac) = (
        rem / 3_600_000,
        rem / 60_000 % 60,
        rem / 1000 % 60,
        rem % 1000,
    );
    if frac == 0 {
        format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
    } else {
        format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{frac:03}Z")
    }
}

/// A span as `3d 4h`, `12m 5s`, `350ms`: the two largest units.
pub fn format_span(ms: u64) -> String {
    const UNITS: [(u64, &str); 5] = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
        (1, "ms"),
    ];
    if ms == 0 {
        return "0s".into();
    }
    let mut parts = Vec::new();
    let mut rest = ms;
    for (size, name) in UNITS {
        if rest >= size {
            parts.push(format!("{}{name}", rest / size));
            rest %= size;
        }
        if parts.len() == 2 || (!parts.is_empty() && size == 1_000) {
            break;
        }
    }
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Millis = 1_796_040_000_000; // 2026-11-30T12:00:00Z

    #[test]
    fn parses_every_form() {
        assert_eq!(format_time(NOW), "2026-11-30T12:00:00Z");
        assert_eq!(parse_time_at("2026-11-30T12:00:00Z", 0), Ok(NOW));
        assert_eq!(parse_time_at("2026-11-30t12:00:00z", 0), Ok(NOW));
        assert_eq!(parse_time_at("2026-11-30 12:00", 0), Ok(NOW));
        assert_eq!(parse_time_at("2026-11-30T12:00:00.25Z", 0), Ok(NOW + 250));
        assert_eq!(
            parse_time_at("2026-11-30T12:00:00.123456Z", 0),
            Ok(NOW + 123)
        );
        assert_eq!(parse_time_at("2026-11-30T13:00:00+01:00", 0), Ok(NOW));
        assert_eq!(parse_time_at("2026-11-30T11:30:00-00:30", 0), Ok(NOW));
        assert_eq!(parse_time_at("2026-11-30", 0), Ok(NOW - 12 * 3_600_000));
        assert_eq!(parse_time_at("1970-01-01T00:00:00Z", 0), Ok(0));
        assert_eq!(parse_time_at("2024-02-29", 0), Ok(1_709_164_800_000));
        assert_eq!(parse_time_at("1796040000000", 0), Ok(NOW));
        assert_eq!(parse_time_at("now", NOW), Ok(NOW));
        assert_eq!(parse_time_at("45s", NOW), Ok(NOW - 45_000));
        assert_eq!(parse_time_at("10m", NOW), Ok(NOW - 600_000));
        assert_eq!(parse_time_at("2h", NOW), Ok(NOW - 7_200_000));
        assert_eq!(parse_time_at("3d", NOW), Ok(NOW - 3 * 86_400_000));
        assert_eq!(parse_time_at("1w", NOW), Ok(NOW - 7 * 86_400_000));
        assert_eq!(parse_time_at("1h30m", NOW), Ok(NOW - 5_400_000));
        assert_eq!(parse_time_at("500ms", NOW), Ok(NOW - 500));
    }

    #[test]
    fn refuses_what_is_not_a_time() {
        for bad in [
            "",
            "yesterday",
            "10x",
            "m10",
            "2026-13-01",
            "2026-02-30",
            "2023-02-29",
            "2026-11-30T25:00Z",
            "2026-11-30T12:00:00+0100",
            "2026-11-30T12:00:00.Z",
            "2026/11/30",
            "-5m",
            "99999999999999999999",
            "10m ago",
            "1969-12-31",
        ] {
            assert!(parse_time_at(bad, NOW).is_err(), "{bad:?} parsed");
        }
        assert!(parse_time_at("3d", 1000).is_err(), "before 1970");
    }

    #[test]
    fn formats_round_trip() {
        for t in [
            0,
            1,
            999,
            86_399_999,
            951_782_400_000,
            NOW,
            NOW + 1,
            4_102_444_800_000,
        ] {
            assert_eq!(
                parse_time_at(&format_time(t), 0),
                Ok(t),
                "{}",
                format_time(t)
            );
        }
        assert_eq!(format_time(951_782_400_000), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn formats_spans() {
        assert_eq!(format_span(0), "0s");
        assert_eq!(format_span(350), "350ms");
        assert_eq!(format_span(65_000), "1m 5s");
        assert_eq!(format_span(3 * 86_400_000 + 4 * 3_600_000 + 5), "3d 4h");
        assert_eq!(format_span(1_500), "1s");
    }
}
