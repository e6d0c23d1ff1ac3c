//! What a server of the internal plane refused, for its role's `/metrics`: calls the
//! authorization table refused (by method and the caller's role) and connections that
//! never became a plane connection (by reason). Refusals are also logged; the counters
//! let an alert see a misconfigured or hostile peer without reading logs.
//!
//! One [`PlaneStats`] per [`super::Plane`] (not process-wide: `baton up` runs every role
//! in one process, and each role reports its own server). Labels are bounded: methods
//! come from the table (anything else is `unknown`), roles from the identity crate.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use baton_identity::Identity;

use super::authz::rule;

/// Counter: calls the authorization table refused, by method and caller role.
pub const CALLS_REFUSED_TOTAL: &str = "baton_plane_calls_refused_total";
/// Counter: connections closed before they could carry a call, by reason.
pub const CONNECTIONS_REFUSED_TOTAL: &str = "baton_plane_connections_refused_total";

/// Why a connection was closed before it carried a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectionRefusal {
    /// The handshake slots were full.
    TooManyHandshakes,
    /// No TLS handshake within the deadline.
    HandshakeTimeout,
    /// The handshake failed (plaintext, another CA, a bad certificate, ...).
    Handshake,
    /// The client sent no certificate.
    NoCertificate,
    /// The certificate names no identity (or more than one).
    NoIdentity,
}

impl ConnectionRefusal {
    pub const ALL: [ConnectionRefusal; 5] = [
        ConnectionRefusal::TooManyHandshakes,
        ConnectionRefusal::HandshakeTimeout,
        ConnectionRefusal::Handshake,
        ConnectionRefusal::NoCertificate,
        ConnectionRefusal::NoIdentity,
    ];

    /// The label value (also the reason in the debug log).
    pub fn as_str(self) -> &'static str {
        match self {
            ConnectionRefusal::TooManyHandshakes => "too_many_handshakes",
            ConnectionRefusal::HandshakeTimeout => "handshake_timeout",
            ConnectionRefusal::Handshake => "handshake",
            ConnectionRefusal::NoCertificate => "no_certificate",
            ConnectionRefusal::NoIdentity => "no_identity",
        }
    }
}

/// Refusal counters of one plane's servers.
#[derive(Debug, Default)]
pub struct PlaneStats {
    connections: [AtomicU64; ConnectionRefusal::ALL.len()],
    /// (method, caller role) -> refused calls.
    calls: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
}

impl PlaneStats {
    pub(crate) fn refuse_connection(&self, why: ConnectionRefusal) {
        self.connections[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn refuse_call(&self, method: &str, caller: Option<&Identity>) {
        let method = rule(method).map_or("unknown", |r| r.method);
        let role = caller.map_or("none", |id| id.role().as_str());
        *self.calls.lock().unwrap_or_else(|e| e.into_inner()).entry((method, role)).or_default() += 1;
    }

    /// Refused connections for `why` so far.
    pub fn connections_refused(&self, why: ConnectionRefusal) -> u64 {
        self.connections[why as usize].load(Ordering::Relaxed)
    }

    /// Refused calls of `method` (a gRPC path) from `role` (`none`: no identity) so far.
    pub fn calls_refused(&self, method: &str, role: &str) -> u64 {
        let calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.iter().filter(|((m, r), _)| *m == method && *r == role).map(|(_, n)| n).sum()
    }

    /// Both counters in the Prometheus text format, for a role's `/metrics`. Every
    /// connection reason is always present (at 0), so an alert's query has a series.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# HELP {CONNECTIONS_REFUSED_TOTAL} Internal-plane connections closed before they carried a call, by reason.");
        let _ = writeln!(out, "# TYPE {CONNECTIONS_REFUSED_TOTAL} counter");
        for why in ConnectionRefusal::ALL {
            let _ = writeln!(out, "{CONNECTIONS_REFUSED_TOTAL}{{reason=\"{}\"}} {}", why.as_str(), self.connections_refused(why));
        }
        let _ = writeln!(out, "# HELP {CALLS_REFUSED_TOTAL} Internal-plane calls the authorization table refused, by method and caller role.");
        let _ = writeln!(out, "# TYPE {CALLS_REFUSED_TOTAL} counter");
        for ((method, role), n) in self.calls.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(out, "{CALLS_REFUSED_TOTAL}{{method=\"{method}\",caller_role=\"{role}\"}} {n}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_identity::Role;

    #[test]
    fn refusals_are_counted_with_bounded_labels() {
        let s = PlaneStats::default();
        let gw = Identity::new(Role::Gateway, "gateway").unwrap();
        s.refuse_call("/baton.coordinator.Coordinator/Register", Some(&gw));
        s.refuse_call("/baton.coordinator.Coordinator/Register", Some(&gw));
        s.refuse_call("/attacker/chosen-path-1", None);
        s.refuse_call("/attacker/chosen-path-2", None);
        s.refuse_connection(ConnectionRefusal::Handshake);
        assert_eq!(s.calls_refused("/baton.coordinator.Coordinator/Register", "gateway"), 2);
        assert_eq!(s.calls_refused("unknown", "none"), 2, "unknown paths share one label value");
        let text = s.render();
        assert!(text.contains("baton_plane_calls_refused_total{method=\"/baton.coordinator.Coordinator/Register\",caller_role=\"gateway\"} 2"), "{text}");
        assert!(text.contains("baton_plane_connections_refused_total{reason=\"handshake\"} 1"), "{text}");
        assert!(text.contains("baton_plane_connections_refused_total{reason=\"no_identity\"} 0"), "{text}");
        assert!(!text.contains("attacker"), "{text}");
    }
}
