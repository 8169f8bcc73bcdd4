//! TLS on rustls with libpq's `sslmode` semantics, and the DSN keys
//! `tokio_postgres::Config` does not read (`sslmode=verify-ca`,
//! `verify-full`, `sslrootcert`, `sslcert`, `sslkey`): taken out of the DSN
//! here before the rest is parsed.
//!
//! | `sslmode`     | TLS                              | certificate checked          |
//! |---------------|----------------------------------|------------------------------|
//! | `disable`     | never                            | —                            |
//! | `allow`, `prefer` (default) | if the server offers it | no                      |
//! | `require`     | always                           | no; with `sslrootcert` as `verify-ca` |
//! | `verify-ca`   | always                           | chains to `sslrootcert`      |
//! | `verify-full` | always                           | chain, and the host name     |

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

use agentstate_core::error::{Result, StateError};

/// libpq's `sslmode`: whether a connection uses TLS and what it checks of
/// the server's certificate (see [`PgOptions::ssl_mode`](super::PgOptions::ssl_mode)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PgSslMode {
    /// No TLS.
    Disable,
    /// TLS when the server offers it, its certificate not checked; plain
    /// otherwise (libpq's default). `sslmode=allow` is read as this too.
    Prefer,
    /// TLS or no connection; the certificate is not checked, unless a root
    /// certificate is given, which makes it [`VerifyCa`](Self::VerifyCa)
    /// (as libpq does).
    Require,
    /// TLS, and the server's certificate must chain to the root
    /// certificate (`sslrootcert`); its host name is not checked.
    VerifyCa,
    /// TLS, the certificate chains to the root certificate and names the
    /// host connected to (a DNS name or an IP address in its SAN).
    VerifyFull,
}

impl PgSslMode {
    pub(crate) fn parse(s: &str) -> Option<PgSslMode> {
        Some(match s {
            "disable" => PgSslMode::Disable,
            "allow" | "prefer" => PgSslMode::Prefer,
            "require" => PgSslMode::Require,
            "verify-ca" => PgSslMode::VerifyCa,
            "verify-full" => PgSslMode::VerifyFull,
            _ => return None,
        })
    }

    /// What `tokio_postgres` is told: TLS never, if offered, or always.
    pub(crate) fn driver(self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as S;
        match self {
            PgSslMode::Disable => S::Disable,
            PgSslMode::Prefer => S::Prefer,
            _ => S::Require,
        }
    }
}

/// The TLS keys a DSN held.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct DsnTls {
    pub(crate) mode: Option<PgSslMode>,
    pub(crate) root_cert: Option<String>,
    pub(crate) cert: Option<String>,
    pub(crate) key: Option<String>,
    /// Not a TLS key, but one the driver does not read either: the
    /// store's `require_sync_standby` (see `PgOptions`).
    pub(crate) require_sync_standby: Option<bool>,
}

impl DsnTls {
    /// Takes one key; false when it is none of the TLS keys.
    fn take(&mut self, key: &str, value: &str) -> std::result::Result<bool, String> {
        match key {
            "sslmode" => {
                self.mode = Some(PgSslMode::parse(value).ok_or_else(|| {
                    format!(
                        "sslmode={value:?}: must be disable, allow, prefer, require, verify-ca or verify-full"
                    )
                })?);
            }
            "sslrootcert" => self.root_cert = Some(value.to_string()),
            "sslcert" => self.cert = Some(value.to_string()),
            "sslkey" => self.key = Some(value.to_string()),
            "require_sync_standby" => {
                self.require_sync_standby = Some(match value {
                    "true" | "on" | "1" | "yes" => true,
                    "false" | "off" | "0" | "no" => false,
                    _ => {
                        return Err(format!(
                            "require_sync_standby={value:?}: must be true or false"
                        ));
                    }
                });
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// `dsn` without its TLS keys, and those keys. A DSN this cannot read is
/// returned whole, for the driver's parser to name what is wrong.
pub(crate) fn split_dsn(dsn: &str) -> std::result::Result<(String, DsnTls), String> {
    let mut tls = DsnTls::default();
    if dsn.starts_with("postgres://") || dsn.starts_with("postgresql://") {
        let Some((base, query)) = dsn.split_once('?') else {
            return Ok((dsn.to_string(), tls));
        };
        let (query, fragment) = match query.split_once('#') {
            Some((q, f)) => (q, Some(f)),
            None => (query, None),
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if !tls.take(&percent_decode(k), &percent_decode(v))? {
                kept.push(pair);
            }
        }
        let mut out = base.to_string();
        if !kept.is_empty() {
            out.push('?');
            out.push_str(&kept.join("&"));
        }
        if let Some(f) = fragment {
            out.push('#');
            out.push_str(f);
        }
        return Ok((out, tls));
    }
    let Some(pairs) = key_values(dsn) else {
        return Ok((dsn.to_string(), tls));
    };
    let mut kept = Vec::new();
    for (k, v, raw) in pairs {
        if !tls.take(&k, &v)? {
            kept.push(raw);
        }
    }
    Ok((kept.join(" "), tls))
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// libpq's `key = value` pairs (values optionally in single quotes, `\`
/// escaping the next character), each with its text as written; `None`
/// when `s` is not of that form.
fn key_values(s: &str) -> Option<Vec<(String, String, &str)>> {
    let b = s.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    let ws = |c: u8| c.is_ascii_whitespace();
    loop {
        while i < b.len() && ws(b[i]) {
            i += 1;
        }
        if i == b.len() {
            return Some(out);
        }
        let start = i;
        while i < b.len() && b[i] != b'=' && !ws(b[i]) {
            i += 1;
        }
        let key = s[start..i].to_string();
        while i < b.len() && ws(b[i]) {
            i += 1;
        }
        if i == b.len() || b[i] != b'=' || key.is_empty() {
            return None;
        }
        i += 1;
        while i < b.len() && ws(b[i]) {
            i += 1;
        }
        let mut value = Vec::new();
        if i < b.len() && b[i] == b'\'' {
            i += 1;
            loop {
                match b.get(i) {
                    None => return None,
                    Some(b'\'') => {
                        i += 1;
                        break;
                    }
                    Some(b'\\') if i + 1 < b.len() => {
                        value.push(b[i + 1]);
                        i += 2;
                    }
                    Some(&c) => {
                        value.push(c);
                        i += 1;
                    }
                }
            }
        } else {
            while i < b.len() && !ws(b[i]) {
                if b[i] == b'\\' && i + 1 < b.len() {
                    i += 1;
                }
                value.push(b[i]);
                i += 1;
            }
        }
        let value = String::from_utf8(value).ok()?;
        out.push((key, value, &s[start..i]));
    }
}

/// What the connections use: no TLS, or this configuration.
pub(crate) struct Tls {
    pub(crate) mode: PgSslMode,
    pub(crate) config: Option<Arc<ClientConfig>>,
}

/// Where TLS settings come from: the DSN's keys, each overridden by the
/// options set in code.
pub(crate) struct TlsSettings<'a> {
    pub(crate) dsn: DsnTls,
    pub(crate) mode: Option<PgSslMode>,
    pub(crate) root_cert: Option<&'a Path>,
    pub(crate) client_cert: Option<(&'a Path, &'a Path)>,
    pub(crate) config: Option<&'a Arc<ClientConfig>>,
}

fn invalid(msg: String) -> StateError {
    StateError::invalid(msg)
}

/// The TLS the connections use, from the DSN's keys and the options.
pub(crate) fn resolve(s: TlsSettings<'_>) -> Result<Tls> {
    let root: Option<PathBuf> = s
        .root_cert
        .map(Path::to_path_buf)
        .or_else(|| s.dsn.root_cert.as_ref().map(PathBuf::from));
    let client: Option<(PathBuf, PathBuf)> = match s.client_cert {
        Some((c, k)) => Some((c.to_path_buf(), k.to_path_buf())),
        None => match (&s.dsn.cert, &s.dsn.key) {
            (Some(c), Some(k)) => Some((c.into(), k.into())),
            (None, None) => None,
            _ => {
                return Err(invalid(
                    "sslcert and sslkey: give both (the client certificate and its key) or neither"
                        .into(),
                ));
            }
        },
    };
    // A configuration built in code: used as is; it asks for TLS unless
    // a mode says otherwise.
    if let Some(config) = s.config {
        let mode = s.mode.or(s.dsn.mode).unwrap_or(PgSslMode::Require);
        return Ok(Tls {
            mode,
            config: (mode != PgSslMode::Disable).then(|| config.clone()),
        });
    }
    // libpq 16: `sslrootcert=system` is the OS's roots, and verify-full.
    let system = root.as_deref() == Some(Path::new("system"));
    let mut mode = s.mode.or(s.dsn.mode).unwrap_or(if system {
        PgSslMode::VerifyFull
    } else {
        PgSslMode::Prefer
    });
    if system && mode != PgSslMode::VerifyFull {
        return Err(invalid(
            "sslrootcert=system: sslmode must be verify-full (or left out), as libpq requires"
                .into(),
        ));
    }
    if mode == PgSslMode::Disable {
        return Ok(Tls { mode, config: None });
    }
    // libpq: `require` with a root certificate is `verify-ca`.
    if mode == PgSslMode::Require && root.is_some() {
        mode = PgSslMode::VerifyCa;
    }
    let verify = matches!(mode, PgSslMode::VerifyCa | PgSslMode::VerifyFull);
    let roots = if verify {
        let path = match root {
            Some(p) => p,
            None => {
                // libpq's default place for it.
                let home = std::env::var_os("HOME").map(PathBuf::from);
                match home.map(|h| h.join(".postgresql/root.crt")) {
                    Some(p) if p.is_file() => p,
                    _ => {
                        return Err(invalid(format!(
                            "sslmode={}: needs the root certificate the server's chains to \
                             (sslrootcert=/path/to/ca.pem in the DSN, or PgOptions::ssl_root_cert)",
                            if mode == PgSslMode::VerifyCa {
                                "verify-ca"
                            } else {
                                "verify-full"
                            }
                        )));
                    }
                }
            }
        };
        Some(if system {
            system_roots()?
        } else {
            load_roots(&path)?
        })
    } else {
        None
    };
    let client = client.map(|(c, k)| load_client(&c, &k)).transpose()?;
    let config = build(roots, mode == PgSslMode::VerifyFull, client)?;
    Ok(Tls {
        mode,
        config: Some(Arc::new(config)),
    })
}

/// ring, given explicitly (not the process default, which another crate
/// may set): no C toolchain beyond ring's own. rustls 0.23.48 deprecates
/// it for lacking post-quantum key exchange, which aws-lc-rs has.
#[allow(deprecated)]
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_roots(path: &Path) -> Result<RootCertStore> {
    let certs = read_certs(path, "sslrootcert")?;
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(invalid(format!(
            "sslrootcert {}: no usable certificate in it",
            path.display()
        )));
    }
    Ok(roots)
}

/// The operating system's root certificates.
fn system_roots() -> Result<RootCertStore> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("; ");
        return Err(invalid(format!(
            "sslrootcert=system: no root certificate found in the system's store{}{why}",
            if why.is_empty() { "" } else { ": " }
        )));
    }
    Ok(roots)
}

fn read_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| invalid(format!("{what} {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(invalid(format!(
            "{what} {}: no PEM certificate in it",
            path.display()
        )));
    }
    Ok(certs)
}

type ClientAuth = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

fn load_client(cert: &Path, key: &Path) -> Result<ClientAuth> {
    let certs = read_certs(cert, "sslcert")?;
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| invalid(format!("sslkey {}: {e}", key.display())))?;
    Ok((certs, key))
}

/// A client configuration: the server's certificate checked against
/// `roots` (its name too when `check_name`), or not at all without roots.
fn build(
    roots: Option<RootCertStore>,
    check_name: bool,
    client: Option<ClientAuth>,
) -> Result<ClientConfig> {
    let provider = provider();
    let inner = roots
        .map(|r| {
            WebPkiServerVerifier::builder_with_provider(Arc::new(r), provider.clone())
                .build()
                .map_err(|e| invalid(format!("sslrootcert: {e}")))
        })
        .transpose()?;
    let verifier = Arc::new(Verifier {
        inner,
        check_name,
        provider: provider.clone(),
    });
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(format!("tls: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    match client {
        None => Ok(builder.with_no_client_auth()),
        Some((certs, key)) => builder
            .with_client_auth_cert(certs, key)
            .map_err(|e| invalid(format!("sslcert/sslkey: {e}"))),
    }
}

/// libpq's checks: none (`require`, `prefer`), the chain (`verify-ca`),
/// the chain and the name (`verify-full`). The handshake's signatures are
/// always checked.
#[derive(Debug)]
struct Verifier {
    inner: Option<Arc<WebPkiServerVerifier>>,
    check_name: bool,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let Some(inner) = &self.inner else {
            return Ok(ServerCertVerified::assertion());
        };
        // The chain is checked before the name: a name error means the
        // chain held.
        match inner.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            r => r,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_only_their_tls_keys() {
        let (rest, tls) = split_dsn(
            "postgres://u:p@h:5432/db?sslmode=verify-full&application_name=x&sslrootcert=%2Ftmp%2Fca.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u:p@h:5432/db?application_name=x");
        assert_eq!(tls.mode, Some(PgSslMode::VerifyFull));
        assert_eq!(tls.root_cert.as_deref(), Some("/tmp/ca.pem"));
        let (rest, tls) = split_dsn("postgresql://h/db?sslmode=require").unwrap();
        assert_eq!(rest, "postgresql://h/db");
        assert_eq!(tls.mode, Some(PgSslMode::Require));
        assert_eq!(split_dsn("postgres://h/db").unwrap().0, "postgres://h/db");
        assert!(split_dsn("postgres://h/db?sslmode=bogus").is_err());
    }

    #[test]
    fn key_values_lose_only_their_tls_keys() {
        let (rest, tls) = split_dsn(
            "host=h password='a b\\'c' sslmode = verify-ca sslrootcert='/x y/ca.pem' sslcert=/c sslkey=/k user=u",
        )
        .unwrap();
        assert_eq!(rest, "host=h password='a b\\'c' user=u");
        assert_eq!(tls.mode, Some(PgSslMode::VerifyCa));
        assert_eq!(tls.root_cert.as_deref(), Some("/x y/ca.pem"));
        assert_eq!(tls.cert.as_deref(), Some("/c"));
        assert_eq!(tls.key.as_deref(), Some("/k"));
        let parsed: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(parsed.get_password(), Some(&b"a b'c"[..]));
    }

    #[test]
    fn verify_modes_need_a_root_certificate() {
        let s = |mode| TlsSettings {
            dsn: DsnTls {
                mode: Some(mode),
                root_cert: Some("/nonexistent/ca.pem".into()),
                ..DsnTls::default()
            },
            mode: None,
            root_cert: None,
            client_cert: None,
            config: None,
        };
        assert!(matches!(
            resolve(s(PgSslMode::VerifyFull)),
            Err(StateError::Invalid { .. })
        ));
        assert!(resolve(s(PgSslMode::Disable)).unwrap().config.is_none());
    }
}
