//! Who may call which method of the internal plane: the one table ([`RULES`]), the layer
//! that enforces it on every server ([`AuthorizeLayer`]), and [`Caller`], the identity a
//! handler sees. docs/SECURITY.md prints the same table; a test keeps the two equal.
//!
//! The table grants by role. What a role may do with a method's fields is the handler's
//! second check: a node registers, renews and leaves only under the name and role of its
//! certificate ([`claim_node`]) and only with the key that holds the name ([`caller_key`]).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use baton_identity::{Identity, Role};
use tonic::codegen::http;
use tonic::Status;

use super::server::PeerInfo;
use super::stats::PlaneStats;

/// One kind of caller a rule admits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allow {
    /// Any holder of this role.
    Role(Role),
    /// The serving node's own identity, from loopback (its Kubernetes preStop hook).
    ThisNode,
}

/// The callers of one gRPC method, and why.
#[derive(Debug)]
pub struct Rule {
    /// The gRPC path, `/package.Service/Method`.
    pub method: &'static str,
    pub allow: &'static [Allow],
    pub why: &'static str,
}

use Allow::{Role as R, ThisNode};
use Role::{Coordinator, Decode, Gateway, Operator, Prefill};

/// Every method of the internal plane. A method not listed is refused to everyone.
pub const RULES: &[Rule] = &[
    Rule { method: "/baton.coordinator.Coordinator/Register", allow: &[R(Prefill), R(Decode)], why: "a node joins, under the name and role of its certificate" },
    Rule { method: "/baton.coordinator.Coordinator/KeepAlive", allow: &[R(Prefill), R(Decode)], why: "a node renews its own lease" },
    Rule { method: "/baton.coordinator.Coordinator/Deregister", allow: &[R(Prefill), R(Decode)], why: "a node leaves, releasing its own lease" },
    Rule { method: "/baton.coordinator.Coordinator/RouteDecode", allow: &[R(Gateway), R(Decode)], why: "the gateway routes each turn; a draining decode node asks where each of its conversations goes, excluding only itself" },
    Rule { method: "/baton.coordinator.Coordinator/RoutePrefill", allow: &[R(Decode)], why: "a decode node asks where to prefill a long tail" },
    Rule { method: "/baton.coordinator.Coordinator/EvictConversation", allow: &[R(Gateway)], why: "a user deleted a conversation" },
    Rule { method: "/baton.coordinator.Coordinator/ListNodes", allow: &[R(Gateway), R(Operator)], why: "fleet inspection" },
    Rule { method: "/baton.coordinator.Coordinator/VouchAdoption", allow: &[R(Decode)], why: "a decode node asked to adopt a conversation checks, as itself, that the caller held it for that owner" },
    Rule { method: "/baton.coordinator.Coordinator/Explain", allow: &[R(Operator)], why: "routing decisions name conversations: operators only" },
    Rule { method: "/baton.node.DecodeNode/Generate", allow: &[R(Gateway)], why: "only the gateway authenticates users, so only it may say whose turn this is" },
    Rule { method: "/baton.node.DecodeNode/ExportPrefix", allow: &[R(Prefill), R(Decode)], why: "a node pulls a warm prefix's KV from the node that holds it" },
    Rule { method: "/baton.node.DecodeNode/AdoptPrefix", allow: &[R(Decode)], why: "a draining decode node hands a conversation to its new owner" },
    Rule { method: "/baton.node.DecodeNode/CachedPrefix", allow: &[R(Decode)], why: "an adopting decode node asks how much of a prefix the source holds" },
    Rule { method: "/baton.node.DecodeNode/Stats", allow: &[R(Coordinator), R(Operator)], why: "fleet inspection" },
    Rule { method: "/baton.node.PrefillNode/Prefill", allow: &[R(Decode)], why: "a decode node hands a long tail to a prefill node" },
    Rule { method: "/baton.node.PrefillNode/Stats", allow: &[R(Coordinator), R(Operator)], why: "fleet inspection" },
    Rule { method: "/baton.node.NodeControl/Evict", allow: &[R(Coordinator)], why: "the coordinator fans a conversation's deletion out to every node, and has a joining node evict the tombstoned ones" },
    Rule { method: "/baton.node.NodeControl/Drain", allow: &[R(Coordinator), R(Operator), ThisNode], why: "rolling upgrades: an operator, or the node's own preStop hook" },
];

/// [`RULES`] as the Markdown table docs/SECURITY.md shows.
pub fn markdown_table() -> String {
    let mut out = String::from("| method | who may call it | why |\n| --- | --- | --- |\n");
    for r in RULES {
        // `/baton.coordinator.Coordinator/Register` reads `Coordinator.Register`.
        let (service, name) = r.method.trim_start_matches('/').split_once('/').unwrap_or_default();
        let method = format!("{}.{name}", service.rsplit('.').next().unwrap_or_default());
        let who: Vec<String> = r
            .allow
            .iter()
            .map(|a| match a {
                Allow::Role(role) => role.to_string(),
                Allow::ThisNode => "the node itself (from loopback)".to_string(),
            })
            .collect();
        out.push_str(&format!("| `{method}` | {} | {} |\n", who.join(", "), r.why));
    }
    out
}

/// The rule for a gRPC path.
pub fn rule(method: &str) -> Option<&'static Rule> {
    RULES.iter().find(|r| r.method == method)
}

/// The caller's identity, as the certificate it presented states it; handlers read it
/// from the request's extensions (absent only in plaintext mode).
#[derive(Clone, Debug)]
pub struct Caller(pub Identity);

/// The identity of the caller of `req` (None in plaintext mode).
pub fn caller<T>(req: &tonic::Request<T>) -> Option<&Identity> {
    req.extensions().get::<Caller>().map(|c| &c.0)
}

/// The caller's certificate key ([`PeerInfo::key`]; None in plaintext mode).
pub fn caller_key<T>(req: &tonic::Request<T>) -> Option<[u8; 32]> {
    req.extensions().get::<PeerInfo>().and_then(|p| p.key)
}

/// Whether the caller of `req` may act as node `node_id` in `role`; always true in
/// plaintext mode. The error names what was claimed and what the certificate says.
pub fn claim_node<T>(req: &tonic::Request<T>, node_id: &str, role: Role) -> Result<(), Status> {
    match caller(req) {
        None => Ok(()),
        Some(id) if id.role() == role && id.may_act_as(node_id) => Ok(()),
        Some(id) => Err(Status::permission_denied(format!(
            "the caller's certificate names {id}; it may not act as {role} node {node_id:?}"
        ))),
    }
}

/// Decides one request: the caller's identity if the table admits it.
pub fn decide(method: &str, peer: Option<&PeerInfo>, me: Option<&Identity>) -> Result<Identity, Status> {
    let Some(id) = peer.and_then(|p| p.identity.as_ref()) else {
        return Err(Status::unauthenticated("no client certificate"));
    };
    let Some(rule) = rule(method) else {
        return Err(Status::permission_denied(format!("{method} is not a method of the internal plane")));
    };
    let this_node = |remote: Option<SocketAddr>| {
        me == Some(id) && (!id.is_pool() || remote.is_some_and(|a| a.ip().is_loopback()))
    };
    let admitted = rule.allow.iter().any(|a| match a {
        Allow::Role(r) => id.role() == *r,
        Allow::ThisNode => this_node(peer.and_then(|p| p.remote)),
    });
    if admitted {
        Ok(id.clone())
    } else {
        Err(Status::permission_denied(format!("{} may not call {method}", id.role())))
    }
}

/// Enforces [`RULES`] in front of a tonic server's services.
#[derive(Clone, Debug)]
pub struct AuthorizeLayer {
    me: Option<Identity>,
    insecure: bool,
    stats: std::sync::Arc<PlaneStats>,
}

impl AuthorizeLayer {
    pub(crate) fn new(me: Option<Identity>, insecure: bool, stats: std::sync::Arc<PlaneStats>) -> Self {
        AuthorizeLayer { me, insecure, stats }
    }
}

impl<S> tower_layer::Layer<S> for AuthorizeLayer {
    type Service = Authorize<S>;

    fn layer(&self, inner: S) -> Authorize<S> {
        Authorize { inner, me: self.me.clone(), insecure: self.insecure, stats: self.stats.clone() }
    }
}

/// The service [`AuthorizeLayer`] wraps around a server's routes.
#[derive(Clone, Debug)]
pub struct Authorize<S> {
    inner: S,
    me: Option<Identity>,
    insecure: bool,
    stats: std::sync::Arc<PlaneStats>,
}

impl<S, B> tower_service::Service<http::Request<B>> for Authorize<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if self.insecure {
            return Box::pin(self.inner.call(req));
        }
        let method = req.uri().path().to_string();
        match decide(&method, req.extensions().get::<PeerInfo>(), self.me.as_ref()) {
            Ok(id) => {
                req.extensions_mut().insert(Caller(id));
                Box::pin(self.inner.call(req))
            }
            Err(status) => {
                let peer = req.extensions().get::<PeerInfo>();
                self.stats.refuse_call(&method, peer.and_then(|p| p.identity.as_ref()));
                tracing::warn!(
                    method = %method,
                    caller = ?peer.and_then(|p| p.identity.as_ref()).map(Identity::dns_name),
                    remote = ?peer.and_then(|p| p.remote),
                    "internal plane: call refused"
                );
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(role: Role, name: &str, remote: &str) -> PeerInfo {
        PeerInfo { remote: Some(remote.parse().unwrap()), identity: Some(Identity::new(role, name).unwrap()), key: Some([7; 32]) }
    }

    /// Every `rpc` of proto/*.proto has exactly one rule, and every rule names an `rpc`.
    #[test]
    fn every_method_of_the_protos_has_one_rule() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/proto");
        let mut methods = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            let package = text.lines().find_map(|l| l.strip_prefix("package ")).map(|p| p.trim_end_matches(';').to_string());
            let mut service = None;
            for line in text.lines().map(str::trim) {
                if let Some(s) = line.strip_prefix("service ") {
                    service = s.split_whitespace().next().map(String::from);
                } else if let Some(r) = line.strip_prefix("rpc ") {
                    let name = r.split('(').next().unwrap().trim();
                    methods.push(format!("/{}.{}/{name}", package.clone().unwrap(), service.clone().unwrap()));
                }
            }
        }
        methods.sort();
        let mut ruled: Vec<String> = RULES.iter().map(|r| r.method.to_string()).collect();
        ruled.sort();
        assert_eq!(methods, ruled);
    }

    /// docs/SECURITY.md shows exactly this table (regenerate it with
    /// `cargo test -p baton-proto -- --ignored print_the_table`).
    #[test]
    fn the_security_doc_shows_the_table() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/SECURITY.md")).unwrap();
        assert!(doc.contains(&markdown_table()), "docs/SECURITY.md's table differs from RULES; it should read:\n{}", markdown_table());
    }

    #[test]
    #[ignore]
    fn print_the_table() {
        print!("{}", markdown_table());
    }

    #[test]
    fn roles_outside_a_rule_are_refused() {
        let m = "/baton.coordinator.Coordinator/Register";
        assert!(decide(m, Some(&peer(Decode, "decode-0", "10.0.0.1:1")), None).is_ok());
        let e = decide(m, Some(&peer(Gateway, "gateway", "10.0.0.1:1")), None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        let e = decide(m, Some(&PeerInfo { remote: None, identity: None, key: None }), None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = decide("/baton.node.DecodeNode/Shutdown", Some(&peer(Operator, "ops", "10.0.0.1:1")), None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
    }

    /// Only a decode identity asks the coordinator to vouch for an adoption (it answers
    /// about conversations and owners, so no other role may probe it).
    #[test]
    fn only_a_decode_node_asks_for_a_voucher() {
        let m = "/baton.coordinator.Coordinator/VouchAdoption";
        assert!(decide(m, Some(&peer(Decode, "decode-0", "10.0.0.1:1")), None).is_ok());
        for role in [Gateway, Prefill, Operator, Coordinator] {
            let e = decide(m, Some(&peer(role, "x", "10.0.0.1:1")), None).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{role}");
        }
    }

    #[test]
    fn a_node_may_drain_itself_and_a_pool_member_only_from_loopback() {
        let m = "/baton.node.NodeControl/Drain";
        let me = Identity::new(Decode, "decode-0").unwrap();
        assert!(decide(m, Some(&peer(Decode, "decode-0", "10.0.0.9:1")), Some(&me)).is_ok());
        assert!(decide(m, Some(&peer(Decode, "decode-1", "127.0.0.1:1")), Some(&me)).is_err());
        let pool = Identity::new(Decode, "*").unwrap();
        assert!(decide(m, Some(&peer(Decode, "*", "127.0.0.1:1")), Some(&pool)).is_ok());
        assert!(decide(m, Some(&peer(Decode, "*", "10.0.0.9:1")), Some(&pool)).is_err(), "another pod of the pool");
    }
}
