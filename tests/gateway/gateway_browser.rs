//! The web chat page at `/` in headless Chromium: runs
//! tests/python/test_web_page.py (Selenium driving the system chromedriver),
//! which gives the page the API key, sends a message and watches the reply
//! stream in, stops a second reply, reloads, and deletes the conversation.
//! Without a Python that has `selenium`, or without chromium and chromedriver,
//! it says it is skipped, unless `BATON_REQUIRE_BROWSER=1` (set by `.ci/run`,
//! which installs them), where it fails instead.

use crate::common;

use std::path::PathBuf;

fn python_with_selenium() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let candidates = [root.join(".cache/venv/bin/python3"), PathBuf::from("python3")];
    candidates
        .into_iter()
        .find(|p| std::process::Command::new(p).args(["-c", "import selenium"]).output().map(|o| o.status.success()).unwrap_or(false))
}

/// The first of `names` found on PATH (Debian's `chromium` and
/// `chromium-driver` packages install /usr/bin/chromium and /usr/bin/chromedriver).
fn on_path(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).flat_map(|dir| names.iter().map(move |n| dir.join(n))).find(|p| p.is_file())
}

fn require_browser() -> bool {
    std::env::var("BATON_REQUIRE_BROWSER").is_ok_and(|v| v == "1")
}

fn missing(what: &str) {
    let msg = format!("{what} (run .ci/run, or apt-get install chromium chromium-driver and pip install selenium)");
    if require_browser() {
        panic!("BATON_REQUIRE_BROWSER=1 but {msg}");
    }
    eprintln!("skipped: {msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn web_page_in_headless_chromium() {
    let Some(python) = python_with_selenium() else {
        return missing("no python3 with the `selenium` package");
    };
    let Some(chromium) = on_path(&["chromium", "chromium-browser"]) else {
        return missing("no chromium on PATH");
    };
    let Some(driver) = on_path(&["chromedriver"]) else {
        return missing("no chromedriver on PATH");
    };
    // Replies long enough to stop one mid-stream, short enough to wait for on a CPU.
    let Some(s) = common::start(&["--default-max-tokens", "160"]).await else { return };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/test_web_page.py");
    let started = std::time::Instant::now();
    let out = tokio::process::Command::new(python)
        .arg(script)
        .env("BATON_URL", &s.base)
        .env("BATON_API_KEY", &s.key)
        .env("BATON_CHROMIUM", &chromium)
        .env("BATON_CHROMEDRIVER", &driver)
        .output()
        .await
        .unwrap();
    let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("web page test took {:.1}s:\n{o}", started.elapsed().as_secs_f64());
    assert!(out.status.success(), "web page test failed:\n{o}\n{e}");
    assert!(o.contains("web page: ok"), "no `web page: ok` in:\n{o}\n{e}");
}
