//! A small fault-injecting UDP relay for the chaos harness: it sits where a node's KV
//! transport (QUIC, so UDP) is advertised and forwards every datagram to the real
//! listener and back, after an added delay and with a chance of dropping it. QUIC's own
//! loss recovery and TLS run end to end through it: the relay sees only ciphertext and
//! cannot forge a peer (the mutual TLS inside still names both nodes).
//!
//! Each client address gets its own upstream socket, so the listener sees one peer per
//! client as without the relay. A test and operator tool, never in a serving path.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::watch;

use crate::rng::Xoshiro256pp;

/// What the relay does to each datagram, both directions.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    /// Added one-way delay.
    pub delay: Duration,
    /// Probability in [0, 1] of dropping a datagram.
    pub loss: f64,
}

/// Datagrams seen by the relay.
#[derive(Debug, Default)]
pub struct ProxyCounters {
    pub forwarded: AtomicU64,
    pub dropped: AtomicU64,
}

/// A running relay; stops when dropped.
pub struct FaultProxy {
    pub listen: SocketAddr,
    pub upstream: SocketAddr,
    faults: watch::Sender<Faults>,
    pub counters: Arc<ProxyCounters>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Binds `listen` and relays to `upstream`, clean until [`FaultProxy::set`]. Needs a
    /// Tokio runtime.
    pub async fn start(listen: SocketAddr, upstream: SocketAddr, seed: u64) -> std::io::Result<FaultProxy> {
        let socket = Arc::new(UdpSocket::bind(listen).await?);
        let listen = socket.local_addr()?;
        let (faults, rx) = watch::channel(Faults::default());
        let counters = Arc::new(ProxyCounters::default());
        let task = tokio::spawn(relay(socket, upstream, rx, counters.clone(), seed));
        Ok(FaultProxy { listen, upstream, faults, counters, task })
    }

    /// Changes the faults from now on.
    pub fn set(&self, faults: Faults) {
        self.faults.send_replace(faults);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Decides the fate of one datagram: `None` drops it, else the delay to send it after.
fn fate(faults: &Faults, rng: &Mutex<Xoshiro256pp>) -> Option<Duration> {
    if faults.loss > 0.0 {
        let draw = rng.lock().map(|mut r| r.next_f64()).unwrap_or(1.0);
        if draw < faults.loss {
            return None;
        }
    }
    Some(faults.delay)
}

/// Sends `data` to `to` on `socket` after `delay`: at once (in order) when zero, else
/// from a task of its own so that later datagrams are not held behind it.
async fn send_later(socket: Arc<UdpSocket>, data: &[u8], to: SocketAddr, delay: Duration) {
    if delay.is_zero() {
        let _ = socket.send_to(data, to).await;
        return;
    }
    let data = data.to_vec();
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        let _ = socket.send_to(&data, to).await;
    });
}

async fn relay(socket: Arc<UdpSocket>, upstream: SocketAddr, faults: watch::Receiver<Faults>, counters: Arc<ProxyCounters>, seed: u64) {
    let rng = Arc::new(Mutex::new(Xoshiro256pp::seed_from_u64(seed)));
    let mut peers: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
    let mut buf = vec![0u8; 65536];
    loop {
        let Ok((n, from)) = socket.recv_from(&mut buf).await else { continue };
        let up = match peers.get(&from) {
            Some(u) => u.clone(),
            None => {
                let bind: SocketAddr = if upstream.is_ipv4() { "0.0.0.0:0".parse().expect("address") } else { "[::]:0".parse().expect("address") };
                let Ok(u) = UdpSocket::bind(bind).await else { continue };
                let u = Arc::new(u);
                // Replies from the listener go back to this client through the front socket.
                tokio::spawn(back(u.clone(), socket.clone(), from, faults.clone(), counters.clone(), rng.clone()));
                peers.insert(from, u.clone());
                u
            }
        };
        let f = *faults.borrow();
        match fate(&f, &rng) {
            Some(delay) => {
                counters.forwarded.fetch_add(1, Ordering::Relaxed);
                send_later(up, &buf[..n], upstream, delay).await;
            }
            None => {
                counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

async fn back(up: Arc<UdpSocket>, front: Arc<UdpSocket>, client: SocketAddr, faults: watch::Receiver<Faults>, counters: Arc<ProxyCounters>, rng: Arc<Mutex<Xoshiro256pp>>) {
    let mut buf = vec![0u8; 65536];
    loop {
        let Ok(n) = up.recv(&mut buf).await else { continue };
        let f = *faults.borrow();
        match fate(&f, &rng) {
            Some(delay) => {
                counters.forwarded.fetch_add(1, Ordering::Relaxed);
                send_later(front.clone(), &buf[..n], client, delay).await;
            }
            None => {
                counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo() -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = s.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            while let Ok((n, from)) = s.recv_from(&mut buf).await {
                let _ = s.send_to(&buf[..n], from).await;
            }
        });
        (addr, task)
    }

    #[tokio::test]
    async fn relays_both_ways_then_delays_and_drops() {
        let (upstream, _echo) = echo().await;
        let proxy = FaultProxy::start("127.0.0.1:0".parse().unwrap(), upstream, 7).await.unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let mut buf = [0u8; 64];
        client.send_to(b"ping", proxy.listen).await.unwrap();
        let (n, from) = tokio::time::timeout(Duration::from_secs(5), client.recv_from(&mut buf)).await.unwrap().unwrap();
        assert_eq!((&buf[..n], from), (&b"ping"[..], proxy.listen), "the reply comes back through the relay");

        proxy.set(Faults { delay: Duration::from_millis(150), loss: 0.0 });
        let t = std::time::Instant::now();
        client.send_to(b"slow", proxy.listen).await.unwrap();
        let (n, _) = tokio::time::timeout(Duration::from_secs(5), client.recv_from(&mut buf)).await.unwrap().unwrap();
        assert_eq!(&buf[..n], b"slow");
        assert!(t.elapsed() >= Duration::from_millis(300), "delayed each way: {:?}", t.elapsed());

        proxy.set(Faults { delay: Duration::ZERO, loss: 1.0 });
        client.send_to(b"lost", proxy.listen).await.unwrap();
        assert!(tokio::time::timeout(Duration::from_millis(300), client.recv_from(&mut buf)).await.is_err(), "dropped");
        assert!(proxy.counters.dropped.load(Ordering::Relaxed) >= 1);
    }
}
