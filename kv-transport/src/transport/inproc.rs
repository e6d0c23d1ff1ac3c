//! In-process transport: a whole cluster inside one process, links are channel pairs.
//!
//! Owns: [`InProcNetwork`] (a registry of listener names), its [`InProcListener`] and
//! [`InProcConnector`].
//! Invariants: channels are bounded (back-pressure like a real link); frames are moved, not
//! serialized, but carry the same checksum as on the wire and are verified the same way;
//! dropping or shutting down a listener unregisters its name and ends all its links.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::error::{Error, Result};
use crate::handoff::frame::Frame;
use crate::handoff::KvReceiver;
use crate::transport::{BoxFuture, Connector, Link, LinkRx, LinkTx, Listener, Peer};

const NAME: &str = "inproc";
/// Frames in flight per direction of a link.
const LINK_DEPTH: usize = 8;
/// Links waiting to be accepted per listener.
const ACCEPT_DEPTH: usize = 64;

/// A namespace of in-process listeners.
#[derive(Default)]
pub struct InProcNetwork {
    listeners: Mutex<HashMap<String, mpsc::Sender<Link>>>,
}

struct ChanTx(mpsc::Sender<Frame>);
struct ChanRx(mpsc::Receiver<Frame>);

impl LinkTx for ChanTx {
    fn send(&mut self, frame: Frame) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            self.0.send(frame).await.map_err(|_| Error::Link {
                transport: NAME,
                detail: "peer closed the link".into(),
            })
        })
    }
}

impl LinkRx for ChanRx {
    fn recv(&mut self) -> BoxFuture<'_, Result<Option<Frame>>> {
        Box::pin(async move { Ok(self.0.recv().await) })
    }
}

/// Two connected links: (sender's end, receiver's end).
fn link_pair() -> (Link, Link) {
    let (a_tx, a_rx) = mpsc::channel(LINK_DEPTH);
    let (b_tx, b_rx) = mpsc::channel(LINK_DEPTH);
    (
        Link {
            tx: Box::new(ChanTx(a_tx)),
            rx: Box::new(ChanRx(b_rx)),
            transport: NAME,
            peer: None,
        },
        Link {
            tx: Box::new(ChanTx(b_tx)),
            rx: Box::new(ChanRx(a_rx)),
            transport: NAME,
            peer: None,
        },
    )
}

impl InProcNetwork {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, mpsc::Sender<Link>>> {
        self.listeners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `name` and serves its links with `receiver`. Needs a Tokio runtime.
    pub fn listen(self: &Arc<Self>, name: &str, receiver: KvReceiver) -> Result<InProcListener> {
        let mut incoming = self.register(name)?;
        let task = tokio::spawn(async move {
            let mut links = JoinSet::new();
            loop {
                tokio::select! {
                    link = incoming.recv() => match link {
                        Some(link) => {
                            let r = receiver.clone();
                            links.spawn(async move { r.serve_link(link).await });
                        }
                        None => break,
                    },
                    Some(_) = links.join_next() => {}
                }
            }
        });
        Ok(InProcListener {
            net: Arc::downgrade(self),
            name: name.to_string(),
            task: task.abort_handle(),
        })
    }

    /// Registers `name` and returns its raw queue of incoming links.
    pub(crate) fn register(&self, name: &str) -> Result<mpsc::Receiver<Link>> {
        let mut map = self.map();
        if map.contains_key(name) {
            return Err(Error::InvalidArgument {
                what: "an in-process listener with that name exists",
            });
        }
        let (tx, rx) = mpsc::channel(ACCEPT_DEPTH);
        map.insert(name.to_string(), tx);
        Ok(rx)
    }

    /// A connector that reaches listeners of this network.
    pub fn connector(self: &Arc<Self>) -> InProcConnector {
        InProcConnector { net: self.clone() }
    }
}

/// Serves one name on an [`InProcNetwork`] until shut down or dropped.
pub struct InProcListener {
    net: Weak<InProcNetwork>,
    name: String,
    task: tokio::task::AbortHandle,
}

impl Listener for InProcListener {
    fn transport(&self) -> &'static str {
        NAME
    }
    fn peer(&self) -> Peer {
        Peer::InProc {
            name: self.name.clone(),
        }
    }
    fn shutdown(&self) {
        if let Some(net) = self.net.upgrade() {
            net.map().remove(&self.name);
        }
        self.task.abort();
    }
}

impl Drop for InProcListener {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Opens links to listeners of one [`InProcNetwork`].
#[derive(Clone)]
pub struct InProcConnector {
    net: Arc<InProcNetwork>,
}

impl Connector for InProcConnector {
    fn transport(&self) -> &'static str {
        NAME
    }

    fn open<'a>(&'a self, peer: &'a Peer) -> BoxFuture<'a, Result<Link>> {
        Box::pin(async move {
            let Peer::InProc { name } = peer else {
                return Err(Error::InvalidArgument {
                    what: "the in-process transport needs an in-process peer",
                });
            };
            let refused = |detail: &str| Error::Connect {
                transport: NAME,
                peer: peer.to_string(),
                detail: detail.to_string(),
            };
            let accept = self.net.map().get(name).cloned();
            let accept = accept.ok_or_else(|| refused("no listener with that name"))?;
            let (ours, theirs) = link_pair();
            accept
                .send(theirs)
                .await
                .map_err(|_| refused("listener closed"))?;
            Ok(ours)
        })
    }
}
