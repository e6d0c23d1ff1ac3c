//! The node's side of the KV transport: its TLS identity, the QUIC endpoint
//! that receives blocks into a staging pool, the connector that sends them, and
//! the conversions between the engine's block bytes and the transport's
//! block-layers.
//!
//! Received blocks land in a staging [`ArenaPool`] (the engine's arena belongs
//! to its worker thread); once a transfer completed they are copied out, the
//! staging blocks released, and the bytes handed to the engine as an import.
//! A transfer that fails releases its staging blocks inside the transport.
//!
//! Which transport carries the blocks is the operator's choice ([`KvTransportArgs`]:
//! `--kv-transport quic|rdma`). Asking for RDMA never stops a node from starting: without
//! the `rdma` cargo feature or without a usable RDMA device the node logs a warning with the
//! reason and runs QUIC ([`KvNode::fallback`]).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};
use baton_engine::kv::WindowRule;
use baton_engine::{DeviceBlockHolder, DeviceBlocks, EngineInfo, ImportBlocks};
use baton_kv_transport::transport::quic::QuicTuning;
use baton_kv_transport::transport::device_memory::{DeviceMemory, DeviceSource, RingMemory};
use baton_kv_transport::transport::select::{bind_node_transport, RdmaConfig, RingPlacement, TransportChoice};
use baton_kv_transport::{ArenaPool, BlockId, BlockSink, BlockSource, KvDtype, KvLayout, KvReceiver, KvSender, Listener, NodeTls, Peer, ReceiverConfig, Reservation};

/// The KV transport a node asks for (`--kv-transport`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvTransportKind {
    /// QUIC with mutual TLS over UDP.
    #[default]
    Quic,
    /// RDMA data path (RC queue pairs), QUIC control channel on the same address; falls
    /// back to QUIC, with a warning naming the reason, where RDMA cannot be used.
    Rdma,
}

/// Where a node's RDMA receive and send rings live (`--rdma-ring-memory`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RingMemoryKind {
    /// Page-locked host memory.
    #[default]
    Host,
    /// The engine's GPU (GPUDirect RDMA through dma-buf); host memory, with a warning
    /// naming the reason, where that cannot be done.
    Device,
}

impl RingMemoryKind {
    /// The request a transport config starts with: device memory is replaced by the GPU's
    /// own at start (`supply_ring_memory`).
    fn request(self) -> RingMemory {
        match self {
            RingMemoryKind::Host => RingMemory::Host,
            RingMemoryKind::Device => RingMemory::Wanted("no device memory was supplied".into()),
        }
    }
}

/// The KV transport flags both node roles share.
#[derive(clap::Args, Clone, Debug)]
pub struct KvTransportArgs {
    /// KV transport: `quic`, or `rdma` (falls back to QUIC, with a warning, when this
    /// build lacks the `rdma` feature or the machine has no usable RDMA device).
    #[arg(long, env = "BATON_KV_TRANSPORT", value_enum, default_value = "quic")]
    pub kv_transport: KvTransportKind,
    /// RDMA device, e.g. mlx5_0 (default: the first one found). Only with `--kv-transport rdma`.
    #[arg(long, env = "BATON_RDMA_DEVICE")]
    pub rdma_device: Option<String>,
    /// RDMA port number on the device, from 1.
    #[arg(long, env = "BATON_RDMA_PORT", default_value_t = RdmaConfig::default().port)]
    pub rdma_port: u8,
    /// Index in the port's GID table (RoCE v2 is often 1 or 3; see `show_gids`).
    #[arg(long, env = "BATON_RDMA_GID_INDEX", default_value_t = RdmaConfig::default().gid_index)]
    pub rdma_gid_index: u8,
    /// Slots per RDMA link (frames in flight on one link; each slot is 1 MiB plus framing).
    #[arg(long, env = "BATON_RDMA_SLOTS", default_value_t = RdmaConfig::default().slots)]
    pub rdma_slots: u32,
    /// RDMA links open at once per listener and per connector; each has its own ring of
    /// `--rdma-slots` slots, registered when the node starts.
    #[arg(long, env = "BATON_RDMA_RINGS", default_value_t = RdmaConfig::default().rings)]
    pub rdma_rings: u32,
    /// Where the RDMA rings live: `host`, or `device` (the engine's GPU memory, registered
    /// with the NIC through dma-buf: frames land in the receive rings without host staging,
    /// and an exported layer goes from the GPU into a send ring and out without host
    /// staging; needs a CUDA engine, a driver that exports dma-bufs and a NIC driver that
    /// imports them, else host memory with a warning naming the reason). Each receive ring
    /// is still its own registration: a peer's key reaches only its ring, never the KV
    /// arena; send rings are registered for local access only.
    #[arg(long, env = "BATON_RDMA_RING_MEMORY", value_enum, default_value = "host")]
    pub rdma_ring_memory: RingMemoryKind,
}

impl TryFrom<KvTransportArgs> for TransportChoice {
    type Error = Error;
    fn try_from(a: KvTransportArgs) -> Result<Self> {
        if a.rdma_port == 0 {
            return Err(Error::config("--rdma-port counts from 1"));
        }
        if a.rdma_slots == 0 || a.rdma_rings == 0 {
            return Err(Error::config("--rdma-slots and --rdma-rings must be positive"));
        }
        if a.rdma_device.as_deref() == Some("") {
            return Err(Error::config("--rdma-device must not be empty (leave it out for the first device)"));
        }
        Ok(match a.kv_transport {
            KvTransportKind::Quic => TransportChoice::Quic,
            KvTransportKind::Rdma => TransportChoice::Rdma(RdmaConfig {
                device: a.rdma_device,
                port: a.rdma_port,
                gid_index: a.rdma_gid_index,
                slots: a.rdma_slots,
                rings: a.rdma_rings,
                ring_memory: a.rdma_ring_memory.request(),
                send_ring_memory: a.rdma_ring_memory.request(),
                ..RdmaConfig::default()
            }),
        })
    }
}

/// Supplies the device memory `--rdma-ring-memory device` asked for: receive rings' and
/// send rings' worth of the GPU `gpu` the engine runs on (`backend` is the engine's
/// description; `layout` sizes a receive slot). Where that cannot be, each request keeps
/// the reason, and the listener or connector reports its host-memory fallback with it.
/// Does nothing for any other choice.
pub fn supply_ring_memory(choice: &mut TransportChoice, backend: &str, gpu: usize, layout: KvLayout) {
    let TransportChoice::Rdma(config) = choice else { return };
    let usable = if !cfg!(feature = "rdma") {
        Err("this build has no RDMA support".to_string())
    } else if !backend.starts_with("cuda") {
        Err(format!("the engine does not run on CUDA ({})", backend.split(' ').next().unwrap_or(backend)))
    } else {
        Ok(())
    };
    let receive_bytes = u32::try_from(layout.bytes_per_block_layer()).ok().and_then(|block_layer| config.device_ring_bytes(block_layer));
    let send_bytes = config.device_send_ring_bytes();
    for (rings, bytes) in [(&mut config.ring_memory, receive_bytes), (&mut config.send_ring_memory, send_bytes)] {
        if !matches!(rings, RingMemory::Wanted(_)) {
            continue;
        }
        let supplied = usable.clone().and_then(|()| bytes.ok_or_else(|| "the rings' size overflows".to_string())).and_then(|bytes| gpu_ring_memory(gpu, bytes));
        *rings = match supplied {
            Ok(mem) => RingMemory::Device(mem),
            Err(why) => RingMemory::Wanted(why),
        };
    }
}

/// Device memory for the staging pool, where the receive rings are in device memory
/// (`--rdma-ring-memory device`, supplied): `bytes` of the same GPU, so that a frame's
/// payload goes from its ring slot into a staging block, and from there into the engine's
/// arena, without leaving the GPU. `None` (host staging) otherwise, or where the GPU cannot
/// give it (logged).
pub fn device_staging_memory(choice: &TransportChoice, gpu: usize, bytes: usize) -> Option<DeviceMemory> {
    let TransportChoice::Rdma(config) = choice else { return None };
    let RingMemory::Device(_) = config.ring_memory else { return None };
    gpu_ring_memory(gpu, bytes)
        .inspect_err(|why| tracing::warn!(reason = %why, "the KV staging pool cannot use device memory; using host memory"))
        .ok()
}

/// `bytes` of GPU `gpu` exported as a dma-buf, described for the transport.
#[cfg(feature = "cuda")]
fn gpu_ring_memory(gpu: usize, bytes: usize) -> std::result::Result<DeviceMemory, String> {
    use baton_kv_transport::transport::device_memory::DeviceCopy;
    struct CudaRing(baton_kernels::cuda::dmabuf::DmaBuf);
    impl DeviceCopy for CudaRing {
        fn read(&self, offset: usize, dst: &mut [u8]) -> std::result::Result<(), String> {
            self.0.read(offset, dst)
        }
        fn write(&self, offset: usize, src: &[u8]) -> std::result::Result<(), String> {
            self.0.write(offset, src)
        }
        fn checksum(&self, offset: usize, len: usize) -> std::result::Result<u32, String> {
            self.0.checksum(offset, len)
        }
        fn copy_rows_to_device(&self, offset: usize, row_bytes: usize, rows: usize, dst: u64, dst_pitch: usize) -> std::result::Result<(), String> {
            self.0.copy_rows_to_device(offset, row_bytes, rows, dst, dst_pitch)
        }
        fn copy_from_device(&self, offset: usize, src: u64, len: usize) -> std::result::Result<(), String> {
            self.0.copy_from_device(offset, src, len)
        }
    }
    let buf = baton_kernels::cuda::dmabuf::DmaBuf::on_gpu(gpu, bytes).map_err(|e| e.to_string())?;
    let (device_addr, len, dmabuf_fd) = (buf.device_addr(), buf.len(), buf.fd());
    let ring = Arc::new(CudaRing(buf));
    Ok(DeviceMemory { device_addr, len, dmabuf_fd, label: format!("cuda:{gpu}"), copy: ring.clone(), keeper: ring })
}

#[cfg(not(feature = "cuda"))]
fn gpu_ring_memory(_gpu: usize, _bytes: usize) -> std::result::Result<DeviceMemory, String> {
    Err("this build has no CUDA backend (cargo feature `cuda` is off)".into())
}

/// A layer the engine kept on its GPU ([`baton_kernels::KvBytes::into_device`]) as bytes
/// the KV transport sends from there; the GPU memory goes back to the engine when the last
/// frame made from it was sent.
pub fn device_source(bytes: Box<dyn baton_kernels::DeviceKvBytes>) -> Arc<dyn DeviceSource> {
    struct Kept(Box<dyn baton_kernels::DeviceKvBytes>);
    impl DeviceSource for Kept {
        fn device_addr(&self) -> u64 {
            self.0.device_addr()
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn read(&self, offset: usize, dst: &mut [u8]) -> std::result::Result<(), String> {
            self.0.read(offset, dst)
        }
    }
    Arc::new(Kept(bytes))
}

/// The transport's view of the engine's block layout.
pub fn transport_layout(info: &EngineInfo) -> Result<KvLayout> {
    let l = info.kv_layout;
    let dtype = match l.dtype.name() {
        "f16" => KvDtype::F16,
        "bf16" => KvDtype::Bf16,
        "f32" => KvDtype::F32,
        "f8e4m3" => KvDtype::F8E4M3,
        other => return Err(Error::config(format!("KV dtype {other} cannot be transported"))),
    };
    let layout = KvLayout { layers: l.layers as u32, block_tokens: l.block_tokens as u32, kv_heads: l.kv_heads as u32, head_dim: l.head_dim as u32, dtype };
    if layout.bytes_per_block() != l.block_bytes() {
        return Err(Error::config(format!("transport block of {} bytes differs from the engine's {}", layout.bytes_per_block(), l.block_bytes())));
    }
    Ok(layout)
}

/// Loads `ca.pem`, `<name>.pem` and `<name>.key` from `dir` (as `baton certs` writes them).
pub fn load_tls(dir: &Path, name: &str) -> Result<NodeTls> {
    Ok(NodeTls::from_dir(dir, name)?)
}

/// `name@host:port`, the form nodes advertise their KV endpoint in.
pub fn endpoint_string(name: &str, addr: SocketAddr) -> String {
    format!("{name}@{addr}")
}

/// Parses an advertised KV endpoint.
pub fn parse_endpoint(s: &str) -> Result<Peer> {
    let (name, addr) = s.split_once('@').ok_or_else(|| Error::config(format!("KV endpoint {s:?} is not name@host:port")))?;
    let addr: SocketAddr = addr.parse().map_err(|e| Error::config(format!("KV endpoint address {addr:?}: {e}")))?;
    Ok(Peer::Net { addr, server_name: name.to_string() })
}

/// Gauge, always 1: labels `transport` (in use) and `requested` (`--kv-transport`).
pub const KV_TRANSPORT_INFO: &str = "baton_kv_transport_info";

/// The node's KV transport: receiving into a staging pool, sending from exports.
pub struct KvNode {
    pub layout: KvLayout,
    pub staging: Arc<ArenaPool>,
    pub receiver: KvReceiver,
    pub sender: KvSender,
    /// Accepts links until dropped (or shut down).
    pub listener: Box<dyn Listener>,
    /// Where the listener is bound (the QUIC endpoint; for RDMA its control channel).
    pub local_addr: SocketAddr,
    /// What this node advertises (`name@addr`).
    pub endpoint: String,
    /// The transport asked for (`quic`, `rdma`).
    pub requested: &'static str,
    /// The transport in use (`quic`, `rdma`); the `transport` label of its metrics.
    pub transport: &'static str,
    /// Why RDMA was asked for and QUIC runs instead.
    pub fallback: Option<String>,
    /// With RDMA: where the receive rings live (and why not in device memory, if asked).
    pub ring_memory: Option<RingPlacement>,
    /// With RDMA: the same for the send rings. In device memory, an exported layer the
    /// engine kept on its GPU goes out without a copy to the host
    /// ([`KvSender::sends_from_device`]).
    pub send_ring_memory: Option<RingPlacement>,
    /// The engine's sliding windows: what a reservation asks senders not to ship
    /// ([`KvNode::reserve_tail`]). Every layer global unless [`KvNode::with_windows`] said.
    pub window: WindowRule,
}

impl KvNode {
    /// Binds the listener of `choice` on `listen` and creates its connector, falling back
    /// from RDMA to QUIC (with a warning naming the reason) where RDMA cannot be used.
    /// Logs the transport it runs. Needs a Tokio runtime.
    pub fn start(name: &str, listen: SocketAddr, tls: &NodeTls, choice: &TransportChoice, layout: KvLayout, staging_blocks: usize) -> Result<KvNode> {
        Self::start_staging_in(name, listen, tls, choice, layout, staging_blocks, None)
    }

    /// [`KvNode::start`] with the staging pool in `staging_memory` where given
    /// ([`device_staging_memory`]): received blocks stay in device memory until the engine
    /// copies them into its arena there.
    pub fn start_staging_in(name: &str, listen: SocketAddr, tls: &NodeTls, choice: &TransportChoice, layout: KvLayout, staging_blocks: usize, staging_memory: Option<DeviceMemory>) -> Result<KvNode> {
        let pool = match staging_memory {
            Some(mem) => {
                let label = mem.label.clone();
                let pool = ArenaPool::on_device(layout, staging_blocks, mem).map_err(Error::transport("device staging pool"))?;
                tracing::info!(device = %label, blocks = staging_blocks, "KV staging pool in device memory");
                pool
            }
            None => ArenaPool::new(layout, staging_blocks).map_err(Error::transport("staging pool"))?,
        };
        let staging = Arc::new(pool);
        let receiver = KvReceiver::new(staging.clone(), ReceiverConfig::default()).map_err(Error::transport("KV receiver"))?;
        let tuning = if listen.ip().is_loopback() { QuicTuning::loopback() } else { QuicTuning::default() };
        let requested = choice.name();
        let t = bind_node_transport(choice, listen, name, tls, &tuning, receiver.clone())
            .map_err(Error::transport(format!("starting the KV transport ({requested}) on {listen}")))?;
        let transport = t.transport();
        let endpoint = endpoint_string(name, t.local_addr);
        match (&t.fallback, &t.ring_memory, &t.send_ring_memory) {
            (Some(reason), _, _) => tracing::info!(transport, requested, %endpoint, fallback = %reason, "KV transport started (QUIC instead of RDMA)"),
            (None, Some(rings), Some(send)) => tracing::info!(transport, requested, %endpoint, rings = %rings.describe(), send_rings = %send.describe(), "KV transport started"),
            (None, _, _) => tracing::info!(transport, requested, %endpoint, "KV transport started"),
        }
        Ok(KvNode {
            layout,
            staging,
            receiver,
            sender: KvSender::new(t.connector),
            listener: t.listener,
            local_addr: t.local_addr,
            endpoint,
            requested,
            transport,
            fallback: t.fallback,
            ring_memory: t.ring_memory,
            send_ring_memory: t.send_ring_memory,
            window: WindowRule::new(layout.block_tokens as usize, vec![None; layout.layers as usize]),
        })
    }

    /// The same node, reserving by the engine's per-layer sliding windows
    /// (`EngineInfo::layer_windows`).
    pub fn with_windows(self, windows: Vec<Option<usize>>) -> Self {
        KvNode { window: WindowRule::new(self.layout.block_tokens as usize, windows), ..self }
    }

    /// Reserves staging blocks for blocks `start_block..start_block + blocks` of a sequence
    /// whose engine continues at position `next_pos`: each sliding-window layer skips the
    /// leading blocks no row from `next_pos` on reads ([`WindowRule::unread_blocks`], the
    /// rule the engine marks imported blocks by), so they are never shipped.
    pub fn reserve_tail(&self, start_block: usize, blocks: usize, next_pos: usize, deadline: std::time::Duration) -> baton_kv_transport::Result<Reservation> {
        let unread = self.window.unread_blocks(next_pos);
        let skip = (0..self.layout.layers as usize)
            .map(|l| unread.get(l).copied().unwrap_or(0).saturating_sub(start_block).min(blocks) as u32)
            .collect();
        self.receiver.reserve_skipping(blocks, 0..self.layout.layers, skip, Some(deadline))
    }

    /// Appends `baton_kv_transport_info` (Prometheus text): which transport runs, which
    /// was asked for, and where RDMA's receive and send rings live (`none` without RDMA).
    pub fn render_info(&self, out: &mut String) {
        use std::fmt::Write;
        let name = KV_TRANSPORT_INFO;
        let rings = self.ring_memory.as_ref().map_or("none", |r| r.memory);
        let send = self.send_ring_memory.as_ref().map_or("none", |r| r.memory);
        let _ = write!(
            out,
            "# HELP {name} The KV transport this node runs (transport), the one asked for (requested) and where RDMA's receive and send rings live (ring_memory, send_ring_memory)\n# TYPE {name} gauge\n{name}{{transport=\"{}\",requested=\"{}\",ring_memory=\"{rings}\",send_ring_memory=\"{send}\"}} 1\n\n",
            self.transport, self.requested
        );
    }

    /// Completed staging blocks (all layers each) for the engine: copied out and released
    /// from a host pool; from a device pool, left where they are and released once the
    /// engine let go of them ([`DeviceBlocks`]).
    pub fn take_blocks(&self, blocks: &[BlockId]) -> baton_kv_transport::Result<ImportBlocks> {
        if self.staging.device_memory().is_some() {
            let hold = StagedBlocks { pool: self.staging.clone(), blocks: blocks.to_vec() };
            let addrs = blocks.iter().map(|&b| self.staging.block_device_addr(b).map(|a| a.unwrap_or_default())).collect::<baton_kv_transport::Result<Vec<u64>>>()?;
            return Ok(ImportBlocks::Device(DeviceBlocks { addrs, block_bytes: self.layout.bytes_per_block(), holder: Arc::new(hold) }));
        }
        let out: baton_kv_transport::Result<Vec<Vec<u8>>> = blocks.iter().map(|&b| self.staging.read_block(b)).collect();
        self.staging.release(blocks);
        out.map(ImportBlocks::Host)
    }

    /// Staging blocks in use (reserved or being received).
    pub fn staging_used(&self) -> usize {
        self.staging.total_blocks() - self.staging.free_blocks()
    }
}

/// Received blocks in a device staging pool, held for the engine: released when dropped.
struct StagedBlocks {
    pool: Arc<ArenaPool>,
    blocks: Vec<BlockId>,
}

impl DeviceBlockHolder for StagedBlocks {
    fn read_block(&self, i: usize, out: &mut [u8]) -> std::result::Result<(), String> {
        let block = *self.blocks.get(i).ok_or_else(|| format!("block {i} of {}", self.blocks.len()))?;
        let bytes = self.pool.read_block(block).map_err(|e| e.to_string())?;
        out.copy_from_slice(&bytes);
        Ok(())
    }
}

impl Drop for StagedBlocks {
    fn drop(&mut self) {
        self.pool.release(&self.blocks);
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

#[cfg(test)]
mod tests {
    use super::*;
    use baton_kv_transport::generate_dev_certs;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        kv: KvTransportArgs,
    }

    fn choice(args: &[&str]) -> Result<TransportChoice> {
        let flags = Flags::try_parse_from(std::iter::once("node").chain(args.iter().copied())).map_err(|e| Error::Config(e.to_string()))?;
        flags.kv.try_into()
    }

    /// `--rdma-ring-memory device` is a request the node fills at start; where it cannot
    /// (no CUDA engine, no CUDA build, no GPU here) the request carries why, which the
    /// listener reports as its host-memory fallback.
    #[test]
    fn device_rings_are_supplied_or_refused_with_a_reason() {
        if std::env::var_os("BATON_RDMA_RING_MEMORY").is_some() {
            return;
        }
        let wanted = choice(&["--kv-transport", "rdma", "--rdma-ring-memory", "device"]).unwrap();
        let rings = |c: &TransportChoice| match c {
            TransportChoice::Rdma(c) => c.ring_memory.clone(),
            TransportChoice::Quic => panic!("RDMA was asked for"),
        };
        let send_rings = |c: &TransportChoice| match c {
            TransportChoice::Rdma(c) => c.send_ring_memory.clone(),
            TransportChoice::Quic => panic!("RDMA was asked for"),
        };
        assert!(matches!(rings(&wanted), RingMemory::Wanted(_)));
        assert!(matches!(send_rings(&wanted), RingMemory::Wanted(_)), "one flag asks for both");
        assert_eq!(rings(&choice(&["--kv-transport", "rdma"]).unwrap()), RingMemory::Host);
        assert!(choice(&["--kv-transport", "rdma", "--rdma-ring-memory", "gpu"]).is_err());

        let mut on_cpu = wanted.clone();
        supply_ring_memory(&mut on_cpu, "cpu (2 threads, avx2)", 0, LAYOUT);
        let expect = if cfg!(feature = "rdma") { "the engine does not run on CUDA (cpu)" } else { "no RDMA support" };
        for got in [rings(&on_cpu), send_rings(&on_cpu)] {
            let RingMemory::Wanted(why) = got else { panic!("device memory on a CPU engine") };
            assert!(why.contains(expect), "{why}");
        }

        let mut on_cuda = wanted.clone();
        supply_ring_memory(&mut on_cuda, "cuda (NVIDIA H100, sm_90)", 0, LAYOUT);
        match rings(&on_cuda) {
            RingMemory::Wanted(why) if !cfg!(feature = "rdma") => assert!(why.contains("no RDMA support"), "{why}"),
            RingMemory::Wanted(why) if !cfg!(feature = "cuda") => assert!(why.contains("feature `cuda` is off"), "{why}"),
            // A CUDA build: no GPU or no dma-buf export here, named by the backend.
            RingMemory::Wanted(why) => assert!(why.contains("cuda"), "{why}"),
            RingMemory::Device(mem) => {
                assert!(cfg!(feature = "cuda") && mem.dmabuf_fd >= 0 && mem.label == "cuda:0", "{mem:?}");
                let block_layer = LAYOUT.bytes_per_block_layer() as u32;
                let TransportChoice::Rdma(c) = &on_cuda else { unreachable!() };
                assert!(mem.len >= c.device_ring_bytes(block_layer).unwrap());
                let RingMemory::Device(send) = send_rings(&on_cuda) else { panic!("receive rings on the GPU, send rings not") };
                assert!(send.len >= c.device_send_ring_bytes().unwrap() && send.device_addr != mem.device_addr, "{send:?}");
            }
            RingMemory::Host => panic!("a request for device memory became host memory silently"),
        }
        assert_eq!(std::mem::discriminant(&rings(&on_cuda)), std::mem::discriminant(&send_rings(&on_cuda)), "both or neither on the GPU");

        // Host rings and QUIC are left alone.
        let mut quic = TransportChoice::Quic;
        supply_ring_memory(&mut quic, "cuda (x)", 0, LAYOUT);
        assert_eq!(quic, TransportChoice::Quic);
        let mut host = choice(&["--kv-transport", "rdma"]).unwrap();
        supply_ring_memory(&mut host, "cuda (x)", 0, LAYOUT);
        assert_eq!((rings(&host), send_rings(&host)), (RingMemory::Host, RingMemory::Host));
    }

    #[test]
    fn flags_choose_the_transport() {
        // Only meaningful where the environment does not set the flags itself.
        if std::env::var_os("BATON_KV_TRANSPORT").is_some() {
            return;
        }
        assert_eq!(choice(&[]).unwrap(), TransportChoice::Quic);
        assert_eq!(choice(&["--kv-transport", "quic", "--rdma-gid-index", "3"]).unwrap(), TransportChoice::Quic);
        let want = RdmaConfig { device: Some("mlx5_1".into()), gid_index: 3, port: 2, slots: 4, rings: 2, ..RdmaConfig::default() };
        let got = choice(&["--kv-transport", "rdma", "--rdma-device", "mlx5_1", "--rdma-gid-index", "3", "--rdma-port", "2", "--rdma-slots", "4", "--rdma-rings", "2"]).unwrap();
        assert_eq!(got, TransportChoice::Rdma(want));
        assert_eq!(choice(&["--kv-transport", "rdma"]).unwrap(), TransportChoice::Rdma(RdmaConfig::default()));
        assert!(choice(&["--kv-transport", "tcp"]).is_err());
        assert!(choice(&["--kv-transport", "rdma", "--rdma-port", "0"]).is_err());
        assert!(choice(&["--kv-transport", "rdma", "--rdma-slots", "0"]).is_err());
        assert!(choice(&["--kv-transport", "rdma", "--rdma-device", ""]).is_err());
    }

    const LAYOUT: KvLayout = KvLayout { layers: 3, block_tokens: 16, kv_heads: 1, head_dim: 8, dtype: KvDtype::F16 };

    /// Asking for RDMA where it cannot run (no `rdma` feature, or no device: this test
    /// machine) starts both nodes on QUIC, says why, and a transfer between them still
    /// lands byte for byte. Where a device exists, the same transfer runs over RDMA.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rdma_without_a_device_falls_back_to_quic_and_moves_blocks() {
        let certs = generate_dev_certs("test", &["decode-0", "prefill-0"]).unwrap();
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let rdma = TransportChoice::Rdma(RdmaConfig { rings: 2, slots: 2, ..RdmaConfig::default() });
        let decode = KvNode::start("decode-0", loopback, &certs.node_tls("decode-0").unwrap(), &rdma, LAYOUT, 8).unwrap();
        let prefill = KvNode::start("prefill-0", loopback, &certs.node_tls("prefill-0").unwrap(), &rdma, LAYOUT, 8).unwrap();
        for (name, node) in [("decode-0", &decode), ("prefill-0", &prefill)] {
            assert_eq!(node.requested, "rdma");
            assert_ne!(node.local_addr.port(), 0);
            assert_eq!(node.endpoint, endpoint_string(name, node.local_addr));
            match &node.fallback {
                Some(reason) => {
                    assert_eq!(node.transport, "quic");
                    assert_eq!(node.listener.transport(), "quic");
                    if cfg!(feature = "rdma") {
                        assert!(reason.contains("RDMA device"), "{reason}");
                    } else {
                        assert!(reason.contains("feature `rdma` is off"), "{reason}");
                    }
                }
                None => {
                    // RDMA runs only in a build with the feature.
                    assert!(node.transport == "rdma" && cfg!(feature = "rdma"), "no fallback, yet transport {}", node.transport);
                }
            }
            let mut info = String::new();
            node.render_info(&mut info);
            let rings = node.ring_memory.as_ref().map_or("none", |r| r.memory);
            assert_eq!(rings == "none", node.transport == "quic", "rings {rings} on {}", node.transport);
            assert!(info.contains(&format!("{KV_TRANSPORT_INFO}{{transport=\"{}\",requested=\"rdma\",ring_memory=\"{rings}\",send_ring_memory=\"{rings}\"}} 1", node.transport)), "{info}");
        }

        // The prefill node ships two blocks into a reservation on the decode node.
        let bytes = LAYOUT.bytes_per_block();
        let blocks: Vec<Vec<u8>> = (0..2u8).map(|b| (0..bytes).map(|i| (i as u8).wrapping_mul(7).wrapping_add(b * 31)).collect()).collect();
        let reservation = decode.receiver.reserve(blocks.len(), Some(std::time::Duration::from_secs(10))).unwrap();
        let grant = reservation.grant().clone();
        let source = Arc::new(ExportSource { layout: LAYOUT, blocks: blocks.clone() });
        let ids = source.ids();
        let peer = parse_endpoint(&decode.endpoint).unwrap();
        prefill.sender.send(&peer, &grant, source, ids).await.unwrap();
        let landed = reservation.finished().await.unwrap();
        assert_eq!(decode.staging_used(), blocks.len());
        let ImportBlocks::Host(taken) = decode.take_blocks(&landed).unwrap() else { panic!("a host staging pool gives host blocks") };
        assert_eq!(taken, blocks);
        assert_eq!(decode.staging_used(), 0);
        let sent = prefill.sender.stats();
        assert_eq!(sent.transport, prefill.transport);
        assert!(sent.bytes.load(std::sync::atomic::Ordering::Relaxed) >= (2 * bytes) as u64);
    }

    /// A staging pool in device memory: blocks land there (QUIC frames are written into it
    /// from the host), the engine gets them as device blocks, and the staging blocks stay
    /// taken until the engine lets go of them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn device_staging_holds_blocks_until_the_engine_lets_go() {
        use baton_kv_transport::transport::device_memory::host_device::HostDevice;
        let certs = generate_dev_certs("test", &["decode-0", "prefill-0"]).unwrap();
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let (mem, _dev) = HostDevice::memory("cuda:0", ArenaPool::bytes_for(LAYOUT, 4).unwrap());
        let base = mem.device_addr;
        let decode = KvNode::start_staging_in("decode-0", loopback, &certs.node_tls("decode-0").unwrap(), &TransportChoice::Quic, LAYOUT, 4, Some(mem)).unwrap();
        let prefill = KvNode::start("prefill-0", loopback, &certs.node_tls("prefill-0").unwrap(), &TransportChoice::Quic, LAYOUT, 1).unwrap();
        let bytes = LAYOUT.bytes_per_block();
        let blocks: Vec<Vec<u8>> = (0..3u8).map(|b| (0..bytes).map(|i| (i as u8).wrapping_mul(5).wrapping_add(b * 17)).collect()).collect();
        let reservation = decode.receiver.reserve(blocks.len(), Some(std::time::Duration::from_secs(10))).unwrap();
        let grant = reservation.grant().clone();
        let source = Arc::new(ExportSource { layout: LAYOUT, blocks: blocks.clone() });
        let ids = source.ids();
        prefill.sender.send(&parse_endpoint(&decode.endpoint).unwrap(), &grant, source, ids).await.unwrap();
        let landed = reservation.finished().await.unwrap();
        let ImportBlocks::Device(taken) = decode.take_blocks(&landed).unwrap() else { panic!("a device staging pool gives device blocks") };
        assert_eq!(taken.block_bytes, bytes);
        let expect: Vec<u64> = landed.iter().map(|b| base + (b.0 as usize * bytes) as u64).collect();
        assert_eq!(taken.addrs, expect);
        assert_eq!(taken.to_host(0..3).unwrap(), blocks);
        assert_eq!(decode.staging_used(), 3, "held while the engine may still copy them");
        let clone = taken.clone();
        drop(taken);
        assert_eq!(decode.staging_used(), 3);
        drop(clone);
        assert_eq!(decode.staging_used(), 0);
        assert_eq!(decode.staging.double_releases(), 0);
        // Without device rings, no device staging is asked for.
        assert!(device_staging_memory(&TransportChoice::Quic, 0, 1 << 20).is_none());
        let host_rings = TransportChoice::Rdma(RdmaConfig::default());
        assert!(device_staging_memory(&host_rings, 0, 1 << 20).is_none());
    }

    #[tokio::test]
    async fn quic_is_the_default() {
        let certs = generate_dev_certs("test", &["decode-0"]).unwrap();
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let node = KvNode::start("decode-0", loopback, &certs.node_tls("decode-0").unwrap(), &TransportChoice::Quic, LAYOUT, 2).unwrap();
        assert_eq!((node.requested, node.transport, node.fallback.as_deref()), ("quic", "quic", None));
    }
}
