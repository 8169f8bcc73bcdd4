//! Passwords never shown: the one routine every error message, `Debug`
//! and the CLI use to print a connection string.

/// The value printed in place of a secret.
const MASK: &str = "***";

/// Query parameters and `key=value` fields whose value is a secret.
fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    matches!(
        k.as_str(),
        "password" | "pass" | "passwd" | "pwd" | "sslpassword" | "secret" | "token" | "auth"
    ) || k.ends_with("password")
        || k.ends_with("secret")
        || k.ends_with("token")
}

/// A connection string with every password masked, for printing.
///
/// URLs (`postgres://user:pw@host/db?password=pw`, `redis://:pw@host`,
/// `rediss://user:pw@host`) are read by a URL parser: the userinfo's
/// password and every secret-named query parameter (`password`,
/// `sslpassword`, `token`, …) become `***`. libpq's `key=value` form
/// (`host=db user=app password='p w'`) is read by its own quoting rules
/// and its secret-named values masked. Anything that is neither (a file
/// path) comes back as given, unless it holds something that looks like a
/// secret field, which then masks the whole string.
///
/// ```
/// use agentstate::redact_connection_string as redact;
/// assert_eq!(redact("postgres://app:hunter2@db:5432/agents"), "postgres://app:***@db:5432/agents");
/// assert_eq!(redact("host=db password='hunter 2' user=app"), "host=db password=*** user=app");
/// assert_eq!(redact("redis://db:6379/0?password=hunter2"), "redis://db:6379/0?password=***");
/// assert_eq!(redact("/var/lib/agents/state"), "/var/lib/agents/state");
/// ```
pub fn redact_connection_string(s: &str) -> String {
    if let Some(masked) = redact_url(s) {
        return masked;
    }
    if let Some(masked) = redact_key_values(s) {
        return masked;
    }
    let lower = s.to_ascii_lowercase();
    if ["password", "secret", "token", "@"]
        .iter()
        .any(|w| lower.contains(w))
        && s.contains(['=', ':'])
    {
        return "[a connection string, not shown: it may hold a password]".to_string();
    }
    s.to_string()
}

/// A URL with its secrets masked; `None` when `s` is no URL.
fn redact_url(s: &str) -> Option<String> {
    let (scheme, _) = s.split_once("://")?;
    if scheme.is_empty()
        || !scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    {
        return None;
    }
    let mut url = url::Url::parse(s).ok()?;
    if url.password().is_some() {
        // Only fails for URLs that cannot have a userinfo; this one has one.
        let _ = url.set_password(Some(MASK));
    }
    if url.query().is_some() {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let v = if is_secret_key(&k) {
                    MASK.to_string()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        // Rebuilt by hand so the mask is not percent-encoded.
        let query = pairs
            .iter()
            .map(|(k, v)| {
                if v == MASK {
                    format!("{}={MASK}", encode(k))
                } else {
                    format!("{}={}", encode(k), encode(v))
                }
            })
            .collect::<Vec<_>>()
            .join("&");
        url.set_query(None);
        let mut out = url.to_string();
        let fragment = url.fragment().map(|f| format!("#{f}"));
        if let Some(f) = &fragment {
            out.truncate(out.len() - f.len());
        }
        out.push('?');
        out.push_str(&query);
        if let Some(f) = fragment {
            out.push_str(&f);
        }
        return Some(out.replace(&format!(":{}@", encode(MASK)), &format!(":{MASK}@")));
    }
    Some(
        url.to_string()
            .replace(&format!(":{}@", encode(MASK)), &format!(":{MASK}@")),
    )
}

fn encode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// libpq's `key = value …` form with secret values masked; `None` when `s`
/// does not read as that form (every token must be `key=value`).
fn redact_key_values(s: &str) -> Option<String> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if key.is_empty() || chars.next() != Some('=') {
            return None;
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            let mut closed = false;
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.push(chars.next()?),
                    '\'' => {
                        closed = true;
                        break;
                    }
                    c => value.push(c),
                }
            }
            if !closed {
                return None;
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        let shown = if is_secret_key(&key) {
            MASK.to_string()
        } else if value.is_empty() || value.contains([' ', '\'', '\\']) {
            format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
        } else {
            value
        };
        out.push(format!("{key}={shown}"));
    }
    (!out.is_empty()).then(|| out.join(" "))
}

#[cfg(test)]
mod tests {
    use super::redact_connection_string as r;

    #[test]
    fn every_form_loses_its_password() {
        let cases = [
            (
                "postgres://u:hunter2@h:5432/db",
                "postgres://u:***@h:5432/db",
            ),
            (
                "postgresql://u:hunter2@h/db?sslmode=require",
                "postgresql://u:***@h/db?sslmode=require",
            ),
            (
                "postgres://u@h/db?password=hunter2&sslmode=verify-full",
                "postgres://u@h/db?password=***&sslmode=verify-full",
            ),
            (
                "redis://:hunter2@127.0.0.1:6379/0",
                "redis://:***@127.0.0.1:6379/0",
            ),
            (
                "rediss://default:hunter2@cache.example:6380",
                "rediss://default:***@cache.example:6380",
            ),
            (
                "host=db password=hunter2 user=me",
                "host=db password=*** user=me",
            ),
            (
                "host=db password = 'hunter 2' user=me",
                "host=db password=*** user=me",
            ),
            (
                "host=db sslpassword='x\\'y' dbname=a",
                "host=db sslpassword=*** dbname=a",
            ),
            ("/var/lib/state", "/var/lib/state"),
            ("./state dir", "./state dir"),
        ];
        for (given, want) in cases {
            let got = r(given);
            assert_eq!(got, want, "{given}");
            assert!(!got.contains("hunter"), "{given} → {got}");
        }
    }

    #[test]
    fn a_password_with_url_specials_is_masked_whole() {
        for pw in ["p%40ss", "p:ss", "hunter2%2F", "a b"] {
            let got = r(&format!("postgres://u:{pw}@h/db"));
            assert!(got.starts_with("postgres://u:***@h"), "{pw}: {got}");
        }
        let got = r("host=db password='hun''ter' x");
        assert!(!got.contains("hun"), "{got}");
    }
}
