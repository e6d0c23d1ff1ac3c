//! Gateway replicas for the tests that need several: real gateways (router, store, turn
//! runner) on loopback sockets sharing one real PostgreSQL, each with a scripted model.

use baton_api_gateway::generator::Generator;
use baton_api_gateway::store::{ConversationStore, PostgresStore};
use baton_api_gateway::{auth, build_app, load_tokenizer, Args, Config};
use baton_text::chat_template::ChatTemplate;
use baton_text::tokenizer::Tokenizer;
use clap::Parser;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;

/// The test model's tokenizer and template (the gateways tokenize for real), or `None`
/// (the test skips) when the model has not been fetched.
pub fn tokenizer() -> Option<(Arc<Tokenizer>, Arc<ChatTemplate>)> {
    let p = match std::env::var_os("BATON_MODEL") {
        Some(p) => PathBuf::from(p),
        None => baton_text::model_cache::model_cache_dir()?.join("SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    if !p.exists() {
        eprintln!("skipped: model not found at {}; run scripts/fetch-model.sh", p.display());
        return None;
    }
    Some(load_tokenizer(&p).unwrap())
}

#[derive(Parser)]
struct Wrap {
    #[command(flatten)]
    args: Args,
}

/// Starts one gateway per generator on `url`'s database, each parsed from `gateway
/// --db URL` plus `flags`; returns their addresses and a key of user `alice`.
pub async fn start(
    url: &str,
    flags: &[&str],
    generators: Vec<Arc<dyn Generator>>,
    (tokenizer, template): (Arc<Tokenizer>, Arc<ChatTemplate>),
) -> (Vec<SocketAddr>, String) {
    let mut gateways = Vec::new();
    let mut key = String::new();
    for generator in generators {
        let store = PostgresStore::connect(url).await.unwrap();
        if key.is_empty() {
            key = auth::create_key(&store, "alice", "test").await.unwrap();
        }
        let argv = ["gateway", "--db", url].into_iter().chain(flags.iter().copied());
        let config = Config::try_from(Wrap::parse_from(argv).args).unwrap();
        let store: Arc<dyn ConversationStore> = Arc::new(store);
        let app = build_app(config, generator, store, tokenizer.clone(), template.clone(), "smollm2".into()).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        gateways.push(listener.local_addr().unwrap());
        tokio::spawn(baton_api_gateway::server::serve(listener, app, futures::future::pending::<()>()));
    }
    (gateways, key)
}

/// Sends one HTTP/1.0 request with `key`; the connection, to read the answer from.
pub fn send(addr: SocketAddr, method: &str, path: &str, key: &str, body: Option<&Value>) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: gw\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// One HTTP/1.0 request with `key`; the status and the body.
pub fn request(addr: SocketAddr, method: &str, path: &str, key: &str, body: Option<&Value>) -> (u16, String) {
    let mut s = send(addr, method, path, key, body);
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).unwrap();
    let resp = String::from_utf8_lossy(&resp).into_owned();
    let status = resp.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}
