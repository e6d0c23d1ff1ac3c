//! The official `openai` Python client (chat and legacy completions; the Responses
//! and Conversations APIs)
//! against the gateway: runs tests/python/test_openai_client.py. Skips, with
//! a message, only when no Python with `openai` is found (`.ci/run` installs
//! it into .cache/venv, which is tried first).

use crate::common;

use std::path::PathBuf;

fn python_with_openai() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let candidates = [root.join(".cache/venv/bin/python3"), PathBuf::from("python3")];
    candidates
        .into_iter()
        .find(|p| std::process::Command::new(p).args(["-c", "import openai"]).output().map(|o| o.status.success()).unwrap_or(false))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn official_openai_python_client() {
    let Some(python) = python_with_openai() else {
        eprintln!("skipped: no python3 with the `openai` package (run .ci/run or `pip install openai`)");
        return;
    };
    let Some(s) = common::start(&[]).await else { return };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/test_openai_client.py");
    let out =
        tokio::process::Command::new(python).arg(script).env("BATON_URL", &s.base).env("BATON_API_KEY", &s.key).output().await.unwrap();
    let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "python client test failed:\n{o}\n{e}");
    assert!(o.contains("openai client: ok"));
}

/// The Responses and Conversations APIs through the official client:
/// tests/python/test_openai_responses.py, as two users (owner isolation).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn official_openai_python_client_responses() {
    let Some(python) = python_with_openai() else {
        eprintln!("skipped: no python3 with the `openai` package (run .ci/run or `pip install openai`)");
        return;
    };
    let Some(s) = common::start(&[]).await else { return };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/test_openai_responses.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .env("BATON_URL", &s.base)
        .env("BATON_API_KEY", &s.key)
        .env("BATON_API_KEY2", &s.key2)
        .output()
        .await
        .unwrap();
    let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "python responses test failed:\n{o}\n{e}");
    assert!(o.contains("openai responses: ok"), "{o}");
    println!("{o}");
}
