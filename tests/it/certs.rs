//! Test certificates for the TLS servers the PostgreSQL and Redis tests
//! start: one routine for both.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A test CA, a server certificate it signed for 127.0.0.1 and localhost,
/// a client certificate it signed, and another CA that signed nothing
/// here: PEM files made with `openssl` in a temp dir.
pub struct Certs {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    pub other_ca: PathBuf,
}

impl Certs {
    /// Makes them in `dir`; the client certificate's common name is
    /// `client_cn` (PostgreSQL's `cert` authentication takes it as the
    /// user name).
    pub fn make(dir: &Path, client_cn: &str) -> Certs {
        std::fs::create_dir_all(dir).expect("create the certs' dir");
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .stdin(Stdio::null())
                .output()
                .unwrap_or_else(|e| panic!("openssl: {e}; install it: apt-get install -y openssl"));
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for ca in ["ca", "other-ca"] {
            let mut a = vec!["req", "-x509"];
            a.extend(ec);
            let (key, pem, subj) = (
                format!("{ca}.key"),
                format!("{ca}.pem"),
                format!("/CN=agentstate test {ca}"),
            );
            a.extend([
                "-keyout",
                &key,
                "-out",
                &pem,
                "-days",
                "2",
                "-subj",
                &subj,
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ]);
            run(&a);
        }
        for (who, ext) in [
            (
                "server",
                "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth",
            ),
            ("client", "extendedKeyUsage=clientAuth"),
        ] {
            std::fs::write(
                dir.join(format!("{who}.ext")),
                format!("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n{ext}\n"),
            )
            .expect("write the extensions");
            let cn = if who == "client" {
                client_cn.to_string()
            } else {
                "localhost".to_string()
            };
            let (key, csr, pem, extf, subj) = (
                format!("{who}.key"),
                format!("{who}.csr"),
                format!("{who}.pem"),
                format!("{who}.ext"),
                format!("/CN={cn}"),
            );
            let mut a = vec!["req"];
            a.extend(ec);
            a.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
            run(&a);
            run(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &extf,
            ]);
        }
        Certs {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
            other_ca: dir.join("other-ca.pem"),
        }
    }
}
