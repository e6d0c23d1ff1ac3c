//! The Kubernetes actuator against a stand-in API server over real TLS (a CA and a server
//! certificate made here): the scale is read and merge-patched at the named workload's
//! subresource with the current token, an unchanged count is not patched, a server the
//! CA did not sign is refused, and a refusal of the API is an error with its status.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::rustls;

use super::*;

/// What the stand-in saw: method, path, Authorization, Content-Type, body.
type Seen = Arc<Mutex<Vec<(String, String, String, String, String)>>>;

struct Ca {
    pem: String,
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn ca() -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = p.self_signed(&key).unwrap();
    Ca { pem: cert.pem(), cert, key }
}

/// An API server on 127.0.0.1 with a certificate from `ca`, accepting `token` only,
/// holding one replica count for any scale path.
async fn api_server(ca: &Ca, token: &'static str, replicas: u64) -> (String, Seen) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    p.subject_alt_names.push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
    let cert = p.signed_by(&key, &ca.cert, &ca.key).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()))
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Seen::default();
    let state = Arc::new(Mutex::new(replicas));
    // The Lease the manifests create: no holder, resourceVersion 1.
    let lease = Arc::new(Mutex::new(serde_json::json!({"kind": "Lease", "metadata": {"name": "baton-planner", "resourceVersion": "1"}, "spec": {}})));
    let log = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = l.accept().await else { return };
            let (acceptor, log, state, lease) = (acceptor.clone(), log.clone(), state.clone(), lease.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(sock).await else { return };
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                    match tls.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
                let header = |name: &str| {
                    head.lines()
                        .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim().to_string()))
                        .unwrap_or_default()
                };
                let len: usize = header("content-length").parse().unwrap_or(0);
                while buf.len() < head_end + len {
                    match tls.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let body = String::from_utf8_lossy(&buf[head_end..head_end + len]).to_string();
                let mut first = head.split_whitespace();
                let (method, path) = (first.next().unwrap_or("").to_string(), first.next().unwrap_or("").to_string());
                let (auth, kind) = (header("authorization"), header("content-type"));
                log.lock().unwrap().push((method.clone(), path, auth.clone(), kind, body.clone()));
                let (status, reply) = if auth != format!("Bearer {token}") {
                    ("401 Unauthorized", r#"{"kind":"Status","message":"Unauthorized"}"#.to_string())
                } else if path_is_lease(&log.lock().unwrap().last().unwrap().1) {
                    let mut l = lease.lock().unwrap();
                    match method.as_str() {
                        "GET" => ("200 OK", l.to_string()),
                        "PUT" => {
                            let mut v: serde_json::Value = serde_json::from_str(&body).unwrap();
                            if v["metadata"]["resourceVersion"] != l["metadata"]["resourceVersion"] {
                                ("409 Conflict", r#"{"kind":"Status","message":"the object has been modified"}"#.to_string())
                            } else {
                                let next = l["metadata"]["resourceVersion"].as_str().unwrap().parse::<u64>().unwrap() + 1;
                                v["metadata"]["resourceVersion"] = next.to_string().into();
                                *l = v;
                                ("200 OK", l.to_string())
                            }
                        }
                        _ => ("405 Method Not Allowed", "{}".to_string()),
                    }
                } else if !log.lock().unwrap().last().unwrap().1.ends_with("/scale") {
                    ("404 Not Found", r#"{"kind":"Status","message":"not found"}"#.to_string())
                } else {
                    if method == "PATCH" {
                        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                        *state.lock().unwrap() = v["spec"]["replicas"].as_u64().unwrap();
                    }
                    ("200 OK", format!(r#"{{"kind":"Scale","spec":{{"replicas":{}}}}}"#, state.lock().unwrap()))
                };
                let resp = format!("HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}", reply.len());
                let _ = tls.write_all(resp.as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    (format!("https://{addr}"), seen)
}

fn path_is_lease(path: &str) -> bool {
    path == "/apis/coordination.k8s.io/v1/namespaces/baton/leases/baton-planner"
}

fn token_file(dir: &tempfile::TempDir, token: &str) -> PathBuf {
    let p = dir.path().join("token");
    std::fs::write(&p, format!("{token}\n")).unwrap();
    p
}

#[tokio::test]
async fn scales_the_named_workload_with_the_current_token() {
    let ca = ca();
    let (api, seen) = api_server(&ca, "tok-2", 1).await;
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(&dir, "tok-1");
    let k = KubeScaler::new(&api, "baton", ca.pem.as_bytes(), file.clone()).unwrap();
    let decode: Workload = "statefulset/baton-decode".parse().unwrap();
    // The token on disk is stale: refused with the API's status.
    let e = k.set(&decode, 3).await.unwrap_err().to_string();
    assert!(e.contains("401") && e.contains("Unauthorized"), "{e}");
    // Rotated on disk: the next call reads it.
    token_file(&dir, "tok-2");
    assert_eq!(k.set(&decode, 3).await.unwrap(), Some(1));
    assert_eq!(k.replicas(&decode).await.unwrap(), 3);
    // Already there: read, not patched.
    assert_eq!(k.set(&decode, 3).await.unwrap(), None);
    let seen = seen.lock().unwrap().clone();
    let patches: Vec<_> = seen.iter().filter(|s| s.0 == "PATCH").collect();
    assert_eq!(patches.len(), 1, "{seen:?}");
    let (_, path, auth, kind, body) = patches[0];
    assert_eq!(path, "/apis/apps/v1/namespaces/baton/statefulsets/baton-decode/scale");
    assert_eq!(auth, "Bearer tok-2");
    assert_eq!(kind, "application/merge-patch+json");
    assert_eq!(body, r#"{"spec":{"replicas":3}}"#);
    assert!(seen.iter().all(|s| s.1.ends_with("/scale")), "only scale subresources: {seen:?}");
    let prefill: Workload = "deployment/baton-prefill".parse().unwrap();
    k.set(&prefill, 2).await.unwrap();
    assert!(k.url(&prefill).ends_with("/namespaces/baton/deployments/baton-prefill/scale"));
}

#[tokio::test]
async fn a_server_the_cluster_ca_did_not_sign_is_refused() {
    let (real, other) = (ca(), ca());
    let (api, seen) = api_server(&real, "tok", 1).await;
    let dir = tempfile::tempdir().unwrap();
    let k = KubeScaler::new(&api, "baton", other.pem.as_bytes(), token_file(&dir, "tok")).unwrap();
    let e = k.replicas(&"deployment/baton-prefill".parse().unwrap()).await.unwrap_err();
    assert!(format!("{e:#}").contains("calling the Kubernetes API"), "{e:#}");
    assert!(seen.lock().unwrap().is_empty(), "no request reached the server (the token was never sent)");
    // Plain HTTP is refused before any connection.
    assert!(KubeScaler::new("http://127.0.0.1:1", "baton", real.pem.as_bytes(), dir.path().join("token")).is_err());
}

#[test]
fn names_are_checked_before_they_reach_a_url() {
    for bad in ["deployment/../secrets", "pod/x", "deployment/Baton", "deployment/", "statefulset/a/b", "deployment/-x", "baton-decode"] {
        assert!(bad.parse::<Workload>().is_err(), "{bad} accepted");
    }
    let w: Workload = "StatefulSet/baton-decode".parse().unwrap();
    assert_eq!(w.to_string(), "statefulset/baton-decode");
    let dir = tempfile::tempdir().unwrap();
    let c = ca();
    assert!(KubeScaler::new("https://127.0.0.1:1", "kube/system", c.pem.as_bytes(), dir.path().join("t")).is_err());
}

#[test]
fn micro_times_are_rfc3339() {
    use std::time::{Duration, UNIX_EPOCH};
    assert_eq!(super::super::lease::micro_time(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
    let t = UNIX_EPOCH + Duration::from_micros(1_796_425_785_123_456);
    assert_eq!(super::super::lease::micro_time(t), "2026-12-04T23:09:45.123456Z");
    let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
    assert_eq!(super::super::lease::micro_time(leap), "2000-02-29T00:00:00.000000Z");
}

#[tokio::test]
async fn one_replica_leads_and_another_takes_over_when_it_falls_silent() {
    use super::super::lease::Elector;
    let ca = ca();
    let (api, seen) = api_server(&ca, "tok", 1).await;
    let dir = tempfile::tempdir().unwrap();
    let k = KubeScaler::new(&api, "baton", ca.pem.as_bytes(), token_file(&dir, "tok")).unwrap();
    let ttl = Duration::from_millis(400);
    let (mut a, mut b) = (Elector::new("planner-a".into(), ttl).unwrap(), Elector::new("planner-b".into(), ttl).unwrap());
    // Racing for the free Lease: exactly one wins (the other's write conflicts, or it
    // reads the winner's fresh renewal).
    let (ra, rb) = tokio::join!(a.lead(&k), b.lead(&k));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert!(ra ^ rb, "one leader: a {ra} b {rb}");
    let (leader, follower) = if ra { (&mut a, &mut b) } else { (&mut b, &mut a) };
    for _ in 0..3 {
        assert!(leader.lead(&k).await.unwrap(), "the holder renews");
        assert!(!follower.lead(&k).await.unwrap(), "the other stands by while renewals continue");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // The leader falls silent: after the lease duration the other takes over, once.
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    assert!(follower.lead(&k).await.unwrap(), "takeover after {ttl:?} of silence");
    assert!(!leader.lead(&k).await.unwrap(), "the old leader stands by once it sees the new holder");
    let puts = seen.lock().unwrap().iter().filter(|s| s.0 == "PUT" && path_is_lease(&s.1)).count();
    assert!(puts >= 5, "renewals and the takeover are writes: {puts}");
    // Without the Lease object the planner does not lead (the manifests create it).
    let other = KubeScaler::new(&api, "other-ns", ca.pem.as_bytes(), token_file(&dir, "tok")).unwrap();
    assert!(Elector::new("c".into(), ttl).unwrap().lead(&other).await.is_err());
}
