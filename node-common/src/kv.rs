//! The node's side of the KV transport: its TLS identity, the QUIC endpoint
//! that receives blocks into a staging pool, the connector that sends them, and
//! the conversions between the engine's block bytes and the transport's
//! block-layers.
//!
//! Received blocks land in a staging [`ArenaPool`] (the engine's arena belongs
//! to its worker thread); once a transfer completed they are copied out, the
//! staging blocks released, and the bytes handed to the engine as an import.
//! A transfer that fails releases its staging blocks inside the transport.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use baton_engine::EngineInfo;
use baton_kv_transport::transport::quic::{QuicConnector, QuicListener, QuicTuning};
use baton_kv_transport::{ArenaPool, BlockId, BlockSink, BlockSource, Connector, KvDtype, KvLayout, KvReceiver, KvSender, NodeTls, Peer, ReceiverConfig};

/// The transport's view of the engine's block layout.
pub fn transport_layout(info: &EngineInfo) -> Result<KvLayout> {
    let l = info.kv_layout;
    let dtype = match l.dtype.name() {
        "f16" => KvDtype::F16,
        "bf16" => KvDtype::Bf16,
        "f32" => KvDtype::F32,
        "f8e4m3" => KvDtype::F8E4M3,
        other => bail!("KV dtype {other} cannot be transported"),
    };
    let layout = KvLayout { layers: l.layers as u32, block_tokens: l.block_tokens as u32, kv_heads: l.kv_heads as u32, head_dim: l.head_dim as u32, dtype };
    if layout.bytes_per_block() != l.block_bytes() {
        bail!("transport block of {} bytes differs from the engine's {}", layout.bytes_per_block(), l.block_bytes());
    }
    Ok(layout)
}

/// Loads `ca.pem`, `<name>.pem` and `<name>.key` from `dir` (as `baton certs` writes them).
pub fn load_tls(dir: &Path, name: &str) -> Result<NodeTls> {
    let read = |f: String| std::fs::read_to_string(dir.join(&f)).with_context(|| format!("reading {}", dir.join(&f).display()));
    let ca = read("ca.pem".into())?;
    let cert = read(format!("{name}.pem"))?;
    let key = read(format!("{name}.key"))?;
    NodeTls::from_pem(&ca, &cert, &key).context("loading the node's TLS identity")
}

/// `name@host:port`, the form nodes advertise their KV endpoint in.
pub fn endpoint_string(name: &str, addr: SocketAddr) -> String {
    format!("{name}@{addr}")
}

/// Parses an advertised KV endpoint.
pub fn parse_endpoint(s: &str) -> Result<Peer> {
    let (name, addr) = s.split_once('@').with_context(|| format!("KV endpoint {s:?} is not name@host:port"))?;
    let addr: SocketAddr = addr.parse().with_context(|| format!("KV endpoint address {addr:?}"))?;
    Ok(Peer::Net { addr, server_name: name.to_string() })
}

/// The node's KV transport: receiving into a staging pool, sending from exports.
pub struct KvNode {
    pub layout: KvLayout,
    pub staging: Arc<ArenaPool>,
    pub receiver: KvReceiver,
    pub sender: KvSender,
    pub listener: QuicListener,
    /// What this node advertises (`name@addr`).
    pub endpoint: String,
}

impl KvNode {
    /// Binds the QUIC listener on `listen`. Needs a Tokio runtime.
    pub fn start(name: &str, listen: SocketAddr, tls: &NodeTls, layout: KvLayout, staging_blocks: usize) -> Result<KvNode> {
        let staging = Arc::new(ArenaPool::new(layout, staging_blocks).context("staging pool")?);
        let receiver = KvReceiver::new(staging.clone(), ReceiverConfig::default()).context("KV receiver")?;
        let tuning = if listen.ip().is_loopback() { QuicTuning::loopback() } else { QuicTuning::default() };
        let listener = QuicListener::bind(listen, name, tls, &tuning, receiver.clone()).context("binding the QUIC listener")?;
        let connector: Arc<dyn Connector> = Arc::new(QuicConnector::new(tls, &tuning).context("QUIC connector")?);
        let endpoint = endpoint_string(name, listener.local_addr());
        Ok(KvNode { layout, staging, receiver, sender: KvSender::new(connector), listener, endpoint })
    }

    /// Copies completed staging blocks out (all layers each) and releases them.
    pub fn take_blocks(&self, blocks: &[BlockId]) -> baton_kv_transport::Result<Vec<Vec<u8>>> {
        let out = blocks.iter().map(|&b| self.staging.read_block(b)).collect();
        self.staging.release(blocks);
        out
    }

    /// Staging blocks in use (reserved or being received).
    pub fn staging_used(&self) -> usize {
        self.staging.total_blocks() - self.staging.free_blocks()
    }
}

/// Whole exported blocks seen as a transport source: block `i` is `blocks[i]`.
pub struct ExportSource {
    pub layout: KvLayout,
    pub blocks: Vec<Vec<u8>>,
}

impl ExportSource {
    /// Source block IDs `0..n`, in order.
    pub fn ids(&self) -> Vec<BlockId> {
        (0..self.blocks.len() as u32).map(BlockId).collect()
    }
}

impl BlockSource for ExportSource {
    fn layout(&self) -> KvLayout {
        self.layout
    }

    fn read_layer(&self, block: BlockId, layer: u32, out: &mut [u8]) -> baton_kv_transport::Result<()> {
        let bl = self.layout.bytes_per_block_layer();
        let data = self.blocks.get(block.0 as usize).ok_or(baton_kv_transport::Error::Sink { block, layer, what: "no such exported block" })?;
        let start = layer as usize * bl;
        if start + bl > data.len() || out.len() != bl {
            return Err(baton_kv_transport::Error::Sink { block, layer, what: "layer outside the exported block" });
        }
        out.copy_from_slice(&data[start..start + bl]);
        Ok(())
    }
}
