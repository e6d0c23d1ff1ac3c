//! Shared helpers of the gateway's integration tests: a gateway on
//! 127.0.0.1:0 in front of the real engine with the default model, two users
//! with keys, and a client.
#![allow(dead_code)]

use baton_api_gateway::client::Client;
use baton::local_generator::LocalGenerator;
use baton_api_gateway::generator::Generator;
use baton_api_gateway::state::App;
use baton_api_gateway::store::{ConversationStore, SqliteStore};
use baton_api_gateway::{auth, build_app, Args, Config};
use baton_engine::model::load_gguf;
use baton_engine::{Engine, EngineConfig};
use baton_kernels::CpuBackend;

use crate::pg;
use clap::Parser;
use std::ffi::OsString;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The default model, or `None` (the test then says it is skipped), resolved
/// as scripts/fetch-model.sh does.
/// The engine every gateway test runs on: the default model, 2 threads, 64 MiB of KV.
pub fn engine(model: &Path) -> Arc<Engine> {
    let backend = CpuBackend::new(2).unwrap();
    let loaded = load_gguf(&backend, model).unwrap();
    let config = EngineConfig { kv_memory_bytes: 64 << 20, tier2_bytes: 0, max_context: Some(2048), ..Default::default() };
    Arc::new(Engine::start(backend, loaded, config).unwrap())
}

pub fn model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("BATON_MODEL") {
        return Some(PathBuf::from(p));
    }
    let p = baton_text::model_cache::model_cache_dir()?.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipped: model not found at {}; run scripts/fetch-model.sh", p.display());
        None
    }
}

/// The gateway's flags as a command line of their own.
#[derive(Parser)]
pub struct Wrap {
    #[command(flatten)]
    pub args: Args,
}

pub struct Server {
    pub base: String,
    pub app: Arc<App>,
    pub engine: Arc<Engine>,
    pub store: SqliteStore,
    /// Key of user "alice".
    pub key: String,
    /// Key of user "bob".
    pub key2: String,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl Server {
    pub fn client(&self) -> Client {
        Client::new(self.base.clone(), Some(self.key.clone()))
    }
    pub fn client2(&self) -> Client {
        Client::new(self.base.clone(), Some(self.key2.clone()))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        self.engine.shutdown();
    }
}

/// Starts a gateway with extra command-line flags (e.g. `--turns-per-minute 2`).
pub async fn start(flags: &[&str]) -> Option<Server> {
    start_wrapped(flags, |g| g).await
}

/// [`start`], with the engine's generator wrapped by `wrap` (to hold or observe calls).
pub async fn start_wrapped(
    flags: &[&str],
    wrap: impl FnOnce(Arc<dyn Generator>) -> Arc<dyn Generator>,
) -> Option<Server> {
    Some(start_model(&model_path()?, flags, wrap).await)
}

/// [`start_wrapped`] on another model file (e.g. `BATON_GEMMA_MODEL`).
pub async fn start_model(
    model: &Path,
    flags: &[&str],
    wrap: impl FnOnce(Arc<dyn Generator>) -> Arc<dyn Generator>,
) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gw.db");
    let mut argv = vec!["gateway".to_string(), "--db".into(), db.display().to_string()];
    if !flags.contains(&"--resume-grace-seconds") {
        argv.extend(["--resume-grace-seconds".to_string(), "2".to_string()]);
    }
    argv.extend(flags.iter().map(|s| s.to_string()));
    let config = config(argv);
    let engine = engine(model);
    let store = SqliteStore::open(&db).unwrap();
    let key = auth::create_key(&store, "alice", "test").await.unwrap();
    let key2 = auth::create_key(&store, "bob", "test").await.unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let generator = wrap(Arc::new(LocalGenerator::new(engine.clone())));
    let (app, base) = serve_local(config, generator, Arc::new(store.clone()), &engine, async move {
        let _ = rx.await;
    })
    .await;
    Server { base, app, engine, store, key, key2, shutdown: Some(tx), _dir: dir }
}

/// The gateway's validated config from its command line (`argv[0]` is the program name).
pub fn config<I, T>(argv: I) -> Config
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    Config::try_from(Wrap::parse_from(argv).args).unwrap()
}

/// Builds the gateway app for the default model (`engine`'s tokenizer and template) and
/// serves it on 127.0.0.1:0 in a task of the current runtime until `shutdown` resolves;
/// returns the app and its base URL. Every gateway these tests start is wired this way.
pub async fn serve_local(
    config: Config,
    generator: Arc<dyn Generator>,
    store: Arc<dyn ConversationStore>,
    engine: &Engine,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> (Arc<App>, String) {
    serve_app(config, generator, store, engine.tokenizer.clone(), engine.template.clone(), shutdown).await
}

/// [`serve_local`] with the default model's tokenizer and template given (a test whose
/// generator is not the engine loads them with `baton_api_gateway::load_tokenizer`).
pub async fn serve_app(
    config: Config,
    generator: Arc<dyn Generator>,
    store: Arc<dyn ConversationStore>,
    tokenizer: Arc<baton_text::tokenizer::Tokenizer>,
    template: Arc<baton_text::chat_template::ChatTemplate>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> (Arc<App>, String) {
    let app = build_app(config, generator, store, tokenizer, template, "smollm2".into()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let served = app.clone();
    tokio::spawn(async move {
        let _ = baton_api_gateway::server::serve(listener, served, shutdown).await;
    });
    (app, base)
}

/// The body of a response to `request`, as text.
pub async fn text_of(request: reqwest::RequestBuilder) -> String {
    request.send().await.unwrap().text().await.unwrap()
}

/// The engine over the default model and a throwaway PostgreSQL server, or `None` when
/// either is unavailable (the test is then skipped, as each says).
pub fn engine_and_postgres() -> Option<(Arc<Engine>, pg::TempPostgres)> {
    let model = model_path()?;
    let pg = pg::TempPostgres::start()?;
    Some((engine(&model), pg))
}
