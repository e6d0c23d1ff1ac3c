//! The internal plane in one process: a real TLS server with the authorization layer in
//! front of a service, and clients holding different identities.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use baton_identity::{generate_dev_certs, DevCerts, Expect, Role};
use baton_proto::node::node_control_client::NodeControlClient;
use baton_proto::node::node_control_server::{NodeControl, NodeControlServer};
use baton_proto::node::{DrainRequest, DrainResponse, EvictRequest, EvictResponse};
use baton_proto::plane::{authz, Plane};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tonic::{Code, Request, Response, Status};

fn pki() -> &'static DevCerts {
    static PKI: OnceLock<DevCerts> = OnceLock::new();
    PKI.get_or_init(|| generate_dev_certs("plane-test", &["coordinator", "gateway", "decode-0", "decode-1", "kv-only"]).unwrap())
}

fn plane(name: &str) -> Plane {
    Plane::mtls(pki().node_tls(name).unwrap()).unwrap()
}

/// Answers with the caller's identity as the handler sees it.
struct Echo;

#[tonic::async_trait]
impl NodeControl for Echo {
    async fn evict(&self, req: Request<EvictRequest>) -> Result<Response<EvictResponse>, Status> {
        let caller = authz::caller(&req).map(|id| id.dns_name()).unwrap_or_default();
        Ok(Response::new(EvictResponse { blocks_freed: caller.len() as u64 }))
    }

    async fn drain(&self, _: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        Ok(Response::new(DrainResponse::default()))
    }
}

/// NodeControl served as `server` over `plane_of(server)`.
async fn serve(server: Plane) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(server.authorize())
            .add_service(NodeControlServer::new(Echo))
            .serve_with_incoming(server.incoming(l)),
    );
    addr
}

async fn control(client: &Plane, addr: SocketAddr, expect: Expect) -> Result<NodeControlClient<tonic::transport::Channel>, tonic::transport::Error> {
    let endpoint = client.endpoint(&addr.to_string()).unwrap().connect_timeout(Duration::from_secs(3));
    Ok(NodeControlClient::new(client.connect(&endpoint, expect).await?))
}

fn evict() -> EvictRequest {
    EvictRequest { conversation: "c".into(), owner: "alice".into() }
}

#[tokio::test]
async fn the_table_decides_and_the_handler_sees_the_certificate_s_identity() {
    let addr = serve(plane("decode-0")).await;
    let to_decode = Expect::Role(Role::Decode);
    let mut coordinator = control(&plane("coordinator"), addr, to_decode.clone()).await.unwrap();
    let freed = coordinator.evict(evict()).await.unwrap().into_inner().blocks_freed;
    assert_eq!(freed, "coordinator.coordinator.baton".len() as u64, "the handler saw the coordinator's identity");
    let mut gateway = control(&plane("gateway"), addr, to_decode.clone()).await.unwrap();
    assert_eq!(gateway.evict(evict()).await.unwrap_err().code(), Code::PermissionDenied);
    assert_eq!(gateway.drain(DrainRequest { deadline_ms: 1 }).await.unwrap_err().code(), Code::PermissionDenied);
    // A node may drain itself (its preStop hook); another node of its role may not.
    let mut itself = control(&plane("decode-0"), addr, to_decode.clone()).await.unwrap();
    itself.drain(DrainRequest { deadline_ms: 1 }).await.unwrap();
    let mut other = control(&plane("decode-1"), addr, to_decode).await.unwrap();
    assert_eq!(other.drain(DrainRequest { deadline_ms: 1 }).await.unwrap_err().code(), Code::PermissionDenied);
}

#[tokio::test]
async fn a_client_refuses_a_server_that_is_not_who_it_expected() {
    let addr = serve(plane("decode-0")).await;
    let gw = plane("gateway");
    assert!(control(&gw, addr, Expect::Role(Role::Coordinator)).await.is_err());
    assert!(control(&gw, addr, Expect::Node { role: Role::Decode, name: "decode-1".into() }).await.is_err());
    assert!(control(&gw, addr, Expect::Node { role: Role::Decode, name: "decode-0".into() }).await.is_ok());
}

#[tokio::test]
async fn plaintext_and_tls_do_not_mix() {
    let tls_server = serve(plane("decode-0")).await;
    let plain = Plane::insecure_plaintext();
    let refused = match control(&plain, tls_server, Expect::Role(Role::Decode)).await {
        Err(_) => true,
        Ok(mut c) => c.evict(evict()).await.is_err(),
    };
    assert!(refused, "a plaintext client was served by a TLS server");
    let plain_server = serve(Plane::insecure_plaintext()).await;
    assert!(control(&plane("coordinator"), plain_server, Expect::Role(Role::Decode)).await.is_err(), "a TLS client accepted a plaintext server");
}

#[tokio::test]
async fn a_certificate_without_a_role_is_closed_after_the_handshake() {
    let addr = serve(plane("decode-0")).await;
    // The cluster CA signed it, so the TLS handshake itself succeeds; the server then
    // finds no identity in it and closes the connection without serving a byte.
    let tls = pki().node_tls("kv-only").unwrap();
    let config = tls.identity_client_config(b"h2", Expect::Role(Role::Decode)).unwrap();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = TcpStream::connect(addr).await.unwrap();
    let sni = rustls::pki_types::ServerName::try_from("plane.baton").unwrap();
    let mut stream = match connector.connect(sni, tcp).await {
        Ok(s) => s,
        Err(_) => return, // refused during the handshake: also a refusal
    };
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(3), stream.read(&mut buf)).await.expect("the server closes, not waits");
    assert!(matches!(n, Ok(0) | Err(_)), "the server sent {n:?} to a role-less client");
    assert!(Plane::mtls(tls).is_err(), "and such a certificate cannot make a plane");
}
