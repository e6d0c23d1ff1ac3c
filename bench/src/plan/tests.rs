//! `baton plan` against a Prometheus stand-in serving canned answers over real HTTP.

use std::collections::HashMap;
use std::sync::Arc;

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: PlanArgs,
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            out.push(u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap());
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

/// Answers `/api/v1/query` with the value mapped to the query's text (an empty vector for
/// an unknown one, HTTP 400 for a value of "error").
async fn prometheus(answers: HashMap<&'static str, &'static str>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let answers = Arc::new(answers);
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = l.accept().await else {
                return;
            };
            let answers = answers.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16_384];
                let mut n = 0;
                while !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => n += k,
                    }
                }
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let path = head.split_whitespace().nth(1).unwrap_or("");
                let q = decode(path.split_once("query=").map_or("", |x| x.1));
                let (status, body) = match answers.get(q.as_str()) {
                    Some(&"error") => (
                        "400 Bad Request",
                        r#"{"status":"error","error":"bad"}"#.to_string(),
                    ),
                    Some(v) => (
                        "200 OK",
                        format!(
                            r#"{{"status":"success","data":{{"resultType":"vector","result":[{{"metric":{{}},"value":[1,"{v}"]}}]}}}}"#
                        ),
                    ),
                    None => (
                        "200 OK",
                        r#"{"status":"success","data":{"resultType":"vector","result":[]}}"#
                            .to_string(),
                    ),
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}")
}

fn args(url: &str) -> PlanArgs {
    Cli::try_parse_from(["plan", "--prometheus", url, "--itl-target-ms", "50"])
        .unwrap()
        .args
}

fn q(field: &str) -> &'static str {
    QUERIES
        .iter()
        .chain(READY.iter())
        .find(|x| x.0 == field)
        .unwrap()
        .1
}

#[tokio::test]
async fn reads_the_cluster_and_says_why_it_scales_decode() {
    let answers = HashMap::from([
        (q("arrival_turns_per_s"), "20"),
        (q("prompt_tokens_mean"), "3000"),
        (q("reply_tokens_mean"), "400"),
        (q("cached_share"), "0.8"),
        (q("prefill_queue_turns"), "0"),
        (q("ttft_p95_s"), "0.3"),
        (q("itl_p95_s"), "0.046"),
        (q("kv_occupancy"), "0.5"),
        (q("decode_batch_mean"), "NaN"),
        (q("ready_prefill"), "2"),
        (q("ready_decode"), "4"),
    ]);
    let url = prometheus(answers).await;
    let a = args(&url);
    let client = reqwest::Client::new();
    let s = read_signals(&client, &url, 100.0).await.unwrap();
    assert_eq!(s.arrival_turns_per_s, 20.0);
    assert_eq!((s.ready_prefill, s.ready_decode), (2, 4));
    assert_eq!(s.itl_p95_s, Some(0.046));
    // NaN and missing samples are absent signals, not zeros.
    assert_eq!(s.decode_batch_mean, None);
    assert_eq!(s.decode_tokens_per_s_per_node, None);
    let mut p = planner(&a).unwrap();
    let d = decide(&client, &a, &mut p, 100.0).await.unwrap();
    // 46 ms is above 0.9 x 50 ms: the decode pool grows past its 4 ready nodes.
    assert!(d.decode >= 5, "{d:?}");
    assert!(
        d.reasons
            .iter()
            .any(|r| r.text == "why: decode ITL p95 46 ms > 0.9 x target 50 ms"),
        "{:?}",
        d.reasons
    );
    assert!(render(&d).contains("decode -> "));
}

#[tokio::test]
async fn without_an_arrival_rate_the_interval_is_skipped_with_the_reason() {
    let url = prometheus(HashMap::new()).await;
    let client = reqwest::Client::new();
    let e = read_signals(&client, &url, 0.0).await.unwrap_err();
    assert!(format!("{e:#}").contains("no arrival rate"), "{e:#}");
    let url = prometheus(HashMap::from([(q("arrival_turns_per_s"), "error")])).await;
    let e = read_signals(&client, &url, 0.0).await.unwrap_err();
    assert!(format!("{e:#}").contains("Prometheus refused"), "{e:#}");
    // A broken optional signal is dropped, not fatal.
    let url = prometheus(HashMap::from([
        (q("arrival_turns_per_s"), "5"),
        (q("itl_p95_s"), "error"),
    ]))
    .await;
    let s = read_signals(&client, &url, 0.0).await.unwrap();
    assert_eq!((s.arrival_turns_per_s, s.itl_p95_s), (5.0, None));
    // Nothing listening: a clear error.
    let e = read_signals(&client, "http://127.0.0.1:9", 0.0)
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("asking Prometheus"), "{e:#}");
}

#[test]
fn encodes_promql_for_a_url() {
    assert_eq!(
        encode("sum(rate(x{a=\"1\"}[2m]))"),
        "sum%28rate%28x%7Ba%3D%221%22%7D%5B2m%5D%29%29"
    );
    assert_eq!(decode(&encode(q("kv_occupancy"))), q("kv_occupancy"));
}
