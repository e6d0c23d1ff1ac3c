//! Shipping a prefilled tail's KV into the decode node's grant, in one of two modes
//! ([`KvExportMode`], `--kv-export`):
//!
//! - `pipelined` (the default): the engine hands over each layer of the prompt blocks a
//!   forward pass completes right after writing it ([`baton_engine::LayerExport`]);
//!   [`ship_layers`] opens the transfer at the first layer and sends each one as it comes,
//!   so the transfer of layer `l` overlaps the compute of layer `l + 1` (and of later
//!   chunks), and the handoff ends about one layer's transfer after the compute. Where the
//!   transport sends from device memory (RDMA with send rings on the GPU) a layer the
//!   engine kept on its GPU goes out from there ([`baton_kv_transport::Transfer::send_device_blocks`]);
//!   otherwise its bytes come to the host first.
//! - `after-prefill`: the engine copies whole blocks out at the first token and
//!   [`ship_whole`] sends them layer by layer (the handoff follows the compute; kept as the
//!   baseline `baton bench cluster` measures the pipelined mode against).
//!
//! Invariants: a transfer is finished (`Done`) only after the engine said every layer of
//! every block went out ([`baton_engine::LayerExportEvent::Done`]) and the sender owes
//! nothing; an export that ends any other way is cancelled, so the decode node releases
//! its reservation and recomputes (the receiver checks completeness itself as well).
//! Dropping the future of either function drops its transfer, which closes the link: the
//! receiver treats that as the sender gone and releases the blocks.

use std::sync::Arc;
use std::time::Duration;

use baton_engine::{KvExport, LayerExport, LayerExportEvent};
use baton_kernels::KvBytes;
use baton_kv_transport::transport::device_memory::DeviceSource;
use baton_kv_transport::{Grant, Peer, Transfer};
use baton_node_common::kv::{device_source, ExportSource, KvNode};
use tonic::Status;

/// How the prefill node ships a tail's KV (`--kv-export`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvExportMode {
    /// Layer by layer while later layers compute.
    #[default]
    Pipelined,
    /// Whole blocks after the forward pass (the older behaviour; a baseline).
    AfterPrefill,
}

fn unavailable(e: baton_kv_transport::Error) -> Status {
    Status::unavailable(format!("KV transfer failed: {e}"))
}

/// Sends a pipelined export of grant blocks (the prompt's blocks from `start_block` on)
/// as the engine produces it; returns the blocks shipped once the receiver confirmed.
/// `layer_delay` (testing only) pauses after each layer of a run of blocks is sent.
pub async fn ship_layers(kv: Arc<KvNode>, peer: Peer, grant: Grant, start_block: usize, mut layers: LayerExport, layer_delay: Option<Duration>) -> Result<usize, Status> {
    let mut transfer: Option<Transfer> = None;
    let result = async {
        while let Some(event) = layers.recv().await {
            match event {
                LayerExportEvent::Layer(chunk) => {
                    let first = chunk.first_block.checked_sub(start_block).ok_or_else(|| Status::internal("the engine exported a block before the grant"))?;
                    let bytes = layer_bytes(chunk.bytes, kv.sender.sends_from_device()).await?;
                    let t = match &mut transfer {
                        Some(t) => t,
                        // Opened at the first layer, not before: a prefill that fails before
                        // computing anything never touched the grant.
                        None => transfer.insert(kv.sender.open(&peer, &grant).await.map_err(unavailable)?),
                    };
                    let (layer, first) = (chunk.layer as u32, first as u32);
                    match bytes {
                        Exported::Host(bytes) => t.send_blocks(layer, first, &bytes).await,
                        Exported::Device(source) => t.send_device_blocks(layer, first, source).await,
                    }
                    .map_err(unavailable)?;
                    if let Some(d) = layer_delay {
                        tokio::time::sleep(d).await;
                    }
                }
                LayerExportEvent::Done { blocks } => {
                    let t = transfer.take().ok_or_else(|| Status::internal("the export ended before any layer"))?;
                    if blocks != grant.blocks.len() || t.missing() > 0 {
                        tracing::error!(blocks, grant = grant.blocks.len(), missing = t.missing(), "the engine's export does not cover the grant");
                        t.cancel().await;
                        return Err(Status::internal("the exported KV does not cover the grant"));
                    }
                    t.finish().await.map_err(unavailable)?;
                    return Ok(blocks);
                }
            }
        }
        Err(Status::aborted("the prefill ended before its KV was exported"))
    }
    .await;
    if result.is_err() {
        if let Some(t) = transfer {
            t.cancel().await;
        }
    }
    result
}

/// One exported layer's bytes, where they are sent from.
enum Exported {
    Host(Vec<u8>),
    Device(Arc<dyn DeviceSource>),
}

/// The bytes of an exported layer: left on the device where the link sends from there
/// (`from_device`) and the backend kept them there, else on the host. A device backend's
/// copy may still be in flight: it is waited for off the runtime's threads.
async fn layer_bytes(bytes: KvBytes, from_device: bool) -> Result<Exported, Status> {
    if bytes.is_ready() {
        return Ok(Exported::Host(bytes.wait()));
    }
    let waited = tokio::task::spawn_blocking(move || {
        let bytes = match from_device {
            true => match bytes.into_device() {
                Ok(on_device) => return Exported::Device(device_source(on_device)),
                Err(bytes) => bytes,
            },
            false => bytes,
        };
        Exported::Host(bytes.wait())
    });
    waited.await.map_err(|_| Status::internal("waiting for exported KV"))
}

/// Sends a whole export (all blocks, after the forward pass), layer by layer.
pub async fn ship_whole(kv: &KvNode, peer: &Peer, grant: &Grant, export: KvExport, layer_delay: Option<Duration>) -> Result<usize, Status> {
    if export.blocks.len() != grant.blocks.len() {
        return Err(Status::internal("exported blocks do not match the grant"));
    }
    let n_blocks = export.blocks.len();
    let source = Arc::new(ExportSource { layout: kv.layout, blocks: export.blocks });
    let ids = source.ids();
    let mut t = kv.sender.start(peer, grant, source, ids).await.map_err(unavailable)?;
    for layer in grant.layers.clone() {
        t.send_layer(layer).await.map_err(unavailable)?;
        if let Some(d) = layer_delay {
            tokio::time::sleep(d).await;
        }
    }
    t.finish().await.map_err(unavailable)?;
    Ok(n_blocks)
}
