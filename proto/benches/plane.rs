//! What the internal plane's mutual TLS costs per turn: a turn's gRPC shape (a
//! `DecodeNode.Generate` call streaming 64 token events and a final event, as the
//! gateway makes it) against an in-process server, plaintext and mutual TLS side by
//! side in one run, on a connection reused across turns (the gateway keeps one per
//! decode node) and on a new connection per turn (handshake included).
//!
//!   cargo bench -p baton-proto --bench plane
//!
//! Prints p50 and p99 per turn for each of the four cases, and the difference.

use std::pin::Pin;
use std::time::{Duration, Instant};

use baton_identity::{generate_dev_certs, Expect, Role};
use baton_proto::node as pb;
use baton_proto::node::decode_node_client::DecodeNodeClient;
use baton_proto::node::decode_node_server::{DecodeNode, DecodeNodeServer};
use baton_proto::plane::Plane;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

const TOKENS: u32 = 64;
const TURNS: usize = 2000;
const NEW_CONNECTION_TURNS: usize = 300;

struct Fake;

type Events = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeNode for Fake {
    type GenerateStream = Events;

    async fn generate(&self, _: Request<pb::GenerateRequest>) -> Result<Response<Events>, Status> {
        let mut events: Vec<Result<pb::GenerateEvent, Status>> = (0..TOKENS)
            .map(|id| Ok(pb::GenerateEvent { event: Some(pb::generate_event::Event::Token(pb::TokenEvent { id, text: " tok".into(), ..Default::default() })), kv_source: None }))
            .collect();
        events.push(Ok(pb::GenerateEvent { event: Some(pb::generate_event::Event::Finished(pb::FinishedEvent::default())), kv_source: None }));
        Ok(Response::new(Box::pin(tokio_stream::iter(events))))
    }
    async fn export_prefix(&self, _: Request<pb::ExportPrefixRequest>) -> Result<Response<pb::ExportPrefixResponse>, Status> {
        Err(Status::unimplemented("bench"))
    }
    async fn adopt_prefix(&self, _: Request<pb::AdoptPrefixRequest>) -> Result<Response<pb::AdoptPrefixResponse>, Status> {
        Err(Status::unimplemented("bench"))
    }
    async fn cached_prefix(&self, _: Request<pb::CachedPrefixRequest>) -> Result<Response<pb::CachedPrefixResponse>, Status> {
        Err(Status::unimplemented("bench"))
    }
    async fn stats(&self, _: Request<pb::StatsRequest>) -> Result<Response<pb::NodeStats>, Status> {
        Err(Status::unimplemented("bench"))
    }
}

fn request() -> pb::GenerateRequest {
    pb::GenerateRequest {
        turn: Some(pb::Turn { prompt: (0..600).collect(), owner: "alice".into(), platform_prefix_len: 300, conversation: "conv".into() }),
        sampling: Some(pb::SamplingParams { max_tokens: TOKENS, ..Default::default() }),
        prefix_source: String::new(),
        prefix_source_node: String::new(),
    }
}

async fn serve(plane: Plane) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(tonic::transport::Server::builder().layer(plane.authorize()).add_service(DecodeNodeServer::new(Fake)).serve_with_incoming(plane.incoming(l)));
    addr
}

async fn turn(client: &mut DecodeNodeClient<tonic::transport::Channel>) {
    let mut s = client.generate(request()).await.unwrap().into_inner();
    let mut n = 0;
    while let Some(ev) = s.message().await.unwrap() {
        if matches!(ev.event, Some(pb::generate_event::Event::Finished(_))) {
            break;
        }
        n += 1;
    }
    assert_eq!(n, TOKENS);
}

/// p50 and p99 per turn over `turns` turns; `reuse`: one connection for all.
async fn measure(server: &Plane, client: &Plane, reuse: bool, turns: usize) -> (Duration, Duration) {
    let addr = serve(server.clone()).await;
    let expect = Expect::Node { role: Role::Decode, name: "decode-0".into() };
    let endpoint = client.endpoint(&addr).unwrap();
    let mut shared = DecodeNodeClient::new(client.connect(&endpoint, expect.clone()).await.unwrap());
    for _ in 0..50 {
        turn(&mut shared).await; // warm-up
    }
    let mut times = Vec::with_capacity(turns);
    for _ in 0..turns {
        let t = Instant::now();
        if reuse {
            turn(&mut shared).await;
        } else {
            let mut fresh = DecodeNodeClient::new(client.connect(&endpoint, expect.clone()).await.unwrap());
            turn(&mut fresh).await;
        }
        times.push(t.elapsed());
    }
    times.sort();
    (times[turns / 2], times[turns * 99 / 100])
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let pki = generate_dev_certs("bench", &["gateway", "decode-0"]).unwrap();
    let (gateway, decode) = (Plane::mtls(pki.node_tls("gateway").unwrap()).unwrap(), Plane::mtls(pki.node_tls("decode-0").unwrap()).unwrap());
    let plain = Plane::insecure_plaintext();
    rt.block_on(async {
        println!("one turn = Generate with a 600-token prompt, {TOKENS} token events streamed back; per-turn latency in microseconds");
        println!("{:<34} {:>10} {:>10} {:>10} {:>10}", "connection", "plain p50", "mTLS p50", "plain p99", "mTLS p99");
        for (label, reuse, turns) in [("reused (the gateway's case)", true, TURNS), ("new per turn (handshake included)", false, NEW_CONNECTION_TURNS)] {
            let p = measure(&plain, &plain, reuse, turns).await;
            let t = measure(&decode, &gateway, reuse, turns).await;
            println!("{:<34} {:>10.0} {:>10.0} {:>10.0} {:>10.0}", label, us(p.0), us(t.0), us(p.1), us(t.1));
            println!("{:<34} {:>10} {:>+10.0} {:>10} {:>+10.0}", "  mTLS minus plaintext", "", us(t.0) - us(p.0), "", us(t.1) - us(p.1));
        }
    });
}
