//! TLS to PostgreSQL as the URL's `sslmode` says (issue #39: the store always connected
//! in plaintext, so `sslmode=require` could not reach a server that demands TLS), against
//! a real server started by the harness that accepts TCP clients over TLS only, with a
//! certificate for `localhost` signed by a CA made here.

mod pg;

use baton_api_gateway::store::{conformance, now_unix, ConversationStore, PostgresStore};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn ca() -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    Ca { cert: p.self_signed(&key).unwrap(), key }
}

/// A server certificate for `names`, signed by `ca`: (certificate PEM, key PEM).
fn server_cert(ca: &Ca, names: &[&str]) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let p = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    (p.signed_by(&key, &ca.cert, &ca.key).unwrap().pem(), key.serialize_pem())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_store_speaks_tls_as_sslmode_says_and_verify_full_checks_the_name() {
    let ca = ca();
    let (cert, key) = server_cert(&ca, &["localhost"]);
    let Some(pg) = pg::TempPostgres::start_tls(&cert, &key) else { return };
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root.crt");
    std::fs::write(&root, ca.cert.pem()).unwrap();
    let other = dir.path().join("other-ca.crt");
    std::fs::write(&other, crate::ca().cert.pem()).unwrap();
    let port = pg.port();
    // By address: the certificate names `localhost`, not 127.0.0.1.
    let by_addr = |q: &str| format!("postgres://postgres@127.0.0.1:{port}/postgres?{q}");
    // By the certificate's name, reached at the same address.
    let by_name = |q: &str| format!("postgres://postgres@localhost:{port}/postgres?hostaddr=127.0.0.1&{q}");
    let root = root.display();
    let other = other.display();

    let accepted = [
        by_addr("sslmode=require"),
        by_addr("sslmode=prefer"),
        by_addr(""),
        by_addr(&format!("sslmode=verify-ca&sslrootcert={root}")),
        by_name(&format!("sslmode=verify-full&sslrootcert={root}")),
    ];
    for url in &accepted {
        let store = PostgresStore::connect(url).await.unwrap_or_else(|e| panic!("{url}: {e}\n{}", pg.log()));
        let id = format!("c-{}", url.len());
        store.create_conversation(&conformance::conv(&id, "alice", now_unix())).await.unwrap();
        assert!(store.get_conversation("alice", &id).await.unwrap().is_some(), "{url}");
    }

    let refused = [
        // The server allows no plaintext client.
        (by_addr("sslmode=disable"), "no encryption"),
        // The certificate is for `localhost`; the URL's host is 127.0.0.1.
        (by_addr(&format!("sslmode=verify-full&sslrootcert={root}")), "not valid for name"),
        // A CA that did not sign the server's certificate.
        (by_name(&format!("sslmode=verify-full&sslrootcert={other}")), "invalid peer certificate"),
        (by_addr(&format!("sslmode=verify-ca&sslrootcert={other}")), "invalid peer certificate"),
        // `require` with a root file verifies the chain, as libpq does.
        (by_addr(&format!("sslmode=require&sslrootcert={other}")), "invalid peer certificate"),
        // Verification never silently falls back to none.
        (by_name(&format!("sslmode=verify-full&sslrootcert={}/missing.crt", dir.path().display())), "missing.crt"),
    ];
    for (url, why) in &refused {
        let e = PostgresStore::connect(url).await.err().unwrap_or_else(|| panic!("{url} must be refused ({why})"));
        assert!(format!("{e:?}").contains(why) || e.to_string().contains(why), "{url}: expected {why}, got {e}");
    }
}
