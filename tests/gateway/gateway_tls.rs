//! HTTPS on the gateway's listener: a self-signed certificate made here, the
//! gateway (real engine) on 127.0.0.1:0 with `--tls-cert`/`--tls-key`, a
//! client trusting that certificate gets answers, while plain HTTP and a
//! client that does not trust it are refused. Bad flags and files are clear
//! errors at start.

use crate::common;

use baton_api_gateway::{Args, Config};
use clap::Parser;
use std::path::{Path, PathBuf};

#[derive(Parser)]
struct Wrap {
    #[command(flatten)]
    args: Args,
}

/// Writes a self-signed certificate for localhost/127.0.0.1 and its key; returns (cert, key, cert PEM).
fn self_signed(dir: &Path) -> (PathBuf, PathBuf, String) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let pem = ck.cert.pem();
    std::fs::write(&cert, &pem).unwrap();
    std::fs::write(&key, ck.key_pair.serialize_pem()).unwrap();
    (cert, key, pem)
}

fn config(flags: &[&str]) -> anyhow::Result<Config> {
    let mut argv = vec!["gateway"];
    argv.extend_from_slice(flags);
    Config::try_from(Wrap::parse_from(argv).args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn https_with_a_trusted_certificate_and_no_plain_http() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, pem) = self_signed(dir.path());
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let Some(s) = common::start(&["--tls-cert", &cert, "--tls-key", &key]).await else { return };
    let addr = s.base.trim_start_matches("http://").to_string();
    let port = addr.rsplit(':').next().unwrap().to_string();

    let trusting = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(pem.as_bytes()).unwrap())
        .build()
        .unwrap();
    for host in ["127.0.0.1", "localhost"] {
        let url = format!("https://{host}:{port}/healthz");
        let r = trusting.get(&url).send().await.unwrap_or_else(|e| panic!("HTTPS {url}: {e:?}"));
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "ok");
    }
    // An authenticated API call over HTTPS.
    let r = trusting.get(format!("https://127.0.0.1:{port}/v1/models")).bearer_auth(&s.key).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("smollm2"));
    let r = trusting.get(format!("https://127.0.0.1:{port}/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 401, "TLS does not replace the API key");

    // Plain HTTP to the same port gets no HTTP answer.
    let plain = reqwest::Client::builder().build().unwrap();
    let r = plain.get(format!("http://127.0.0.1:{port}/healthz")).send().await;
    assert!(r.is_err(), "plain HTTP must not be served on the TLS port: {r:?}");

    // A client that does not trust the certificate refuses the connection.
    let untrusting = reqwest::Client::builder().use_rustls_tls().tls_built_in_root_certs(false).build().unwrap();
    assert!(untrusting.get(format!("https://127.0.0.1:{port}/healthz")).send().await.is_err());

    // The server is still healthy after the refused connections.
    assert_eq!(trusting.get(format!("https://127.0.0.1:{port}/healthz")).send().await.unwrap().status(), 200);
}

#[test]
fn tls_flags_and_files_are_checked_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, _) = self_signed(dir.path());
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    assert!(config(&[]).unwrap().tls.is_none(), "no flags: plain HTTP");
    assert!(config(&["--tls-cert", &cert, "--tls-key", &key]).unwrap().tls.is_some());

    let err = |flags: &[&str]| format!("{:#}", config(flags).expect_err("must be refused"));
    let e = err(&["--tls-cert", &cert]);
    assert!(e.contains("--tls-cert") && e.contains("without --tls-key"), "{e}");
    let e = err(&["--tls-key", &key]);
    assert!(e.contains("without --tls-cert"), "{e}");

    let missing = dir.path().join("missing.pem").display().to_string();
    let e = err(&["--tls-cert", &missing, "--tls-key", &key]);
    assert!(e.contains("missing.pem"), "{e}");

    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let garbage = garbage.display().to_string();
    let e = err(&["--tls-cert", &garbage, "--tls-key", &key]);
    assert!(e.contains("garbage.pem") && e.contains("certificate"), "{e}");
    let e = err(&["--tls-cert", &cert, "--tls-key", &garbage]);
    assert!(e.contains("garbage.pem") && e.contains("private key"), "{e}");
    // The certificate as the key (a PEM file, but no key in it).
    let e = err(&["--tls-cert", &cert, "--tls-key", &cert]);
    assert!(e.contains("private key"), "{e}");

    // A key that is not the certificate's.
    let other = rcgen::KeyPair::generate().unwrap();
    let other_key = dir.path().join("other-key.pem");
    std::fs::write(&other_key, other.serialize_pem()).unwrap();
    let e = err(&["--tls-cert", &cert, "--tls-key", &other_key.display().to_string()]);
    assert!(e.contains("do not make a TLS server configuration"), "{e}");
}
