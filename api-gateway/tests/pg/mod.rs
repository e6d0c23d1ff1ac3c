//! A throwaway PostgreSQL server for the tests: the one implementation is the root
//! crate's `src/harness/postgres.rs` (also used by `baton chaos`), included by path
//! because this crate cannot depend on the binary's crate. Without PostgreSQL,
//! [`TempPostgres::start`] prints a loud skip message and returns `None`; `.ci/run`
//! installs Debian's `postgresql` so CI runs them.
#![allow(dead_code)]

#[path = "../../../src/harness/postgres.rs"]
mod imp;

/// A running server; stopped on drop. Failures of an installed server panic (a test).
pub struct TempPostgres(imp::TempPostgres);

impl TempPostgres {
    pub fn start() -> Option<Self> {
        match imp::TempPostgres::start() {
            Ok(pg) => Some(TempPostgres(pg)),
            Err(e) if e.is::<imp::NotInstalled>() => {
                eprintln!("\n!!!!! SKIPPED: {e}; the PostgreSQL store is NOT tested !!!!!\n");
                None
            }
            Err(e) => panic!("starting PostgreSQL: {e:#}"),
        }
    }

    /// A server that accepts TCP clients over TLS only, presenting `cert_pem` and `key_pem`.
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Option<Self> {
        match imp::TempPostgres::start_tls(cert_pem, key_pem) {
            Ok(pg) => Some(TempPostgres(pg)),
            Err(e) if e.is::<imp::NotInstalled>() => {
                eprintln!("\n!!!!! SKIPPED: {e}; TLS to PostgreSQL is NOT tested !!!!!\n");
                None
            }
            Err(e) => panic!("starting PostgreSQL with TLS: {e:#}"),
        }
    }

    pub fn port(&self) -> u16 {
        self.0.port
    }

    pub fn url(&self) -> String {
        self.0.url()
    }

    pub fn spawn(&mut self) {
        self.0.spawn().expect("postgres restarts");
    }

    pub fn stop(&mut self) {
        self.0.stop()
    }

    pub fn log(&self) -> String {
        self.0.log()
    }
}
