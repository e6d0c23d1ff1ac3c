//! The boundary between the transport and a node's KV block pool.
//!
//! Owns: [`BlockSink`] (the receiver writes into reserved blocks through it), [`BlockSource`]
//! (the sender reads computed blocks through it) and [`ArenaPool`], a pool that implements
//! both, in host memory (tests, the benchmark, a node's staging pool) or in device memory
//! (a node whose RDMA rings are in GPU memory stages received blocks there too, so that no
//! byte of a frame crosses to the host: [`ArenaPool::on_device`]).
//! Invariants: a sink never accepts a write to a block that is not reserved; `release` of a
//! block that is already free is counted (a bug in the caller) and otherwise ignored, so it
//! can never put a block on the free list twice.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::transport::device_memory::{DeviceBytes, DeviceMemory};
use crate::types::{BlockId, KvLayout};

/// Where received KV lands: the decode node's pool.
pub trait BlockSink: Send + Sync {
    /// The layout of every block in this pool.
    fn layout(&self) -> KvLayout;
    /// Takes `n` free blocks, all or none.
    fn reserve(&self, n: usize) -> Result<Vec<BlockId>>;
    /// Writes one layer of one reserved block. `bytes` is exactly
    /// `layout().bytes_per_block_layer()` long.
    fn write_layer(&self, block: BlockId, layer: u32, bytes: &[u8]) -> Result<()>;
    /// Writes one layer of reserved blocks `blocks` from device memory (`bytes`: their
    /// block-layers back to back), copying on the device: `Ok(false)` (the default) when
    /// this sink cannot take device bytes (host memory, or another device), and the caller
    /// brings them to the host for [`BlockSink::write_layer`].
    fn write_layers_device(&self, _blocks: &[BlockId], _layer: u32, _bytes: DeviceBytes<'_>) -> Result<bool> {
        Ok(false)
    }
    /// Returns blocks to the free list.
    fn release(&self, blocks: &[BlockId]);
    /// Blocks currently free.
    fn free_blocks(&self) -> usize;
}

/// Where sent KV comes from: the prefill node's pool.
pub trait BlockSource: Send + Sync {
    /// The layout of every block in this pool.
    fn layout(&self) -> KvLayout;
    /// Copies one layer of one block into `out` (`layout().bytes_per_block_layer()` long).
    fn read_layer(&self, block: BlockId, layer: u32, out: &mut [u8]) -> Result<()>;
}

struct ArenaState {
    data: Storage,
    free: Vec<BlockId>,
    reserved: Vec<bool>,
}

/// Where a pool's bytes are.
enum Storage {
    Host(Vec<u8>),
    Device(DeviceMemory),
}

impl Storage {
    fn write(&mut self, at: usize, bytes: &[u8]) -> std::result::Result<(), String> {
        match self {
            Storage::Host(data) => {
                data[at..at + bytes.len()].copy_from_slice(bytes);
                Ok(())
            }
            Storage::Device(mem) => mem.copy.write(at, bytes),
        }
    }

    fn read(&self, at: usize, out: &mut [u8]) -> std::result::Result<(), String> {
        match self {
            Storage::Host(data) => {
                out.copy_from_slice(&data[at..at + out.len()]);
                Ok(())
            }
            Storage::Device(mem) => mem.copy.read(at, out),
        }
    }
}

/// A failed copy into or out of a device pool.
fn device_err(block: BlockId, layer: u32, detail: String) -> Error {
    tracing::error!(block = block.0, layer, %detail, "device staging pool copy failed");
    Error::Sink { block, layer, what: "device memory copy failed" }
}

/// A pool of `blocks` blocks in one contiguous arena (host or device memory), with a free
/// list.
///
/// Block `b`, layer `l` lives at `(b * layers + l) * bytes_per_block_layer`: a block's
/// layers are contiguous, as an engine's `kv_blocks_out` packs them.
pub struct ArenaPool {
    layout: KvLayout,
    total: usize,
    state: Mutex<ArenaState>,
    layer_writes: AtomicU64,
    double_releases: AtomicU64,
}

impl ArenaPool {
    /// A pool of `blocks` zeroed blocks, all free.
    pub fn new(layout: KvLayout, blocks: usize) -> Result<Self> {
        let bytes = Self::bytes_for(layout, blocks)?;
        Self::with_storage(layout, blocks, Storage::Host(vec![0u8; bytes]))
    }

    /// A pool of `blocks` blocks in `memory` (which must hold them; its bytes are taken as
    /// they are), all free.
    pub fn on_device(layout: KvLayout, blocks: usize, memory: DeviceMemory) -> Result<Self> {
        if Self::bytes_for(layout, blocks)? > memory.len {
            return Err(Error::InvalidArgument { what: "device memory smaller than the pool" });
        }
        Self::with_storage(layout, blocks, Storage::Device(memory))
    }

    /// Bytes `blocks` blocks of `layout` take.
    pub fn bytes_for(layout: KvLayout, blocks: usize) -> Result<usize> {
        layout.validate()?;
        blocks.checked_mul(layout.bytes_per_block()).ok_or(Error::InvalidArgument { what: "pool size overflows" })
    }

    fn with_storage(layout: KvLayout, blocks: usize, data: Storage) -> Result<Self> {
        let blocks_u32 = u32::try_from(blocks).map_err(|_| Error::InvalidArgument {
            what: "pool has more than u32::MAX blocks",
        })?;
        Ok(ArenaPool {
            layout,
            total: blocks,
            state: Mutex::new(ArenaState {
                data,
                // Pop from the end hands out low IDs first.
                free: (0..blocks_u32).rev().map(BlockId).collect(),
                reserved: vec![false; blocks],
            }),
            layer_writes: AtomicU64::new(0),
            double_releases: AtomicU64::new(0),
        })
    }

    /// Total blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.total
    }

    /// Layer writes accepted so far (tests use it to prove a block was not installed).
    pub fn layer_writes(&self) -> u64 {
        self.layer_writes.load(Ordering::Relaxed)
    }

    /// Releases of blocks that were already free. Always zero unless a caller has a bug.
    pub fn double_releases(&self) -> u64 {
        self.double_releases.load(Ordering::Relaxed)
    }

    /// Copies all layers of a reserved block.
    pub fn read_block(&self, block: BlockId) -> Result<Vec<u8>> {
        let state = self.lock();
        let range = self.block_range(&state, block, 0)?;
        let mut out = vec![0u8; self.layout.bytes_per_block()];
        state.data.read(range.start, &mut out).map_err(|d| device_err(block, 0, d))?;
        Ok(out)
    }

    /// Fills all layers of a reserved block with bytes from a seeded generator.
    pub fn fill_block(&self, block: BlockId, seed: u64) -> Result<()> {
        let mut state = self.lock();
        let start = self.block_range(&state, block, 0)?.start;
        let mut bytes = vec![0u8; self.layout.bytes_per_block()];
        fill_pseudo_random(&mut bytes, seed);
        state.data.write(start, &bytes).map_err(|d| device_err(block, 0, d))
    }

    /// The memory of a device pool (`None` for a host pool).
    pub fn device_memory(&self) -> Option<DeviceMemory> {
        match &self.lock().data {
            Storage::Device(mem) => Some(mem.clone()),
            Storage::Host(_) => None,
        }
    }

    /// The device address of a reserved block's first byte, in a device pool.
    pub fn block_device_addr(&self, block: BlockId) -> Result<Option<u64>> {
        let state = self.lock();
        let start = self.block_range(&state, block, 0)?.start;
        Ok(match &state.data {
            Storage::Device(mem) => Some(mem.device_addr + start as u64),
            Storage::Host(_) => None,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ArenaState> {
        // A panic while holding the lock cannot leave the arena inconsistent: every critical
        // section is a copy or a free-list update that finishes or does not start.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn block_range(
        &self,
        state: &ArenaState,
        block: BlockId,
        layer: u32,
    ) -> Result<std::ops::Range<usize>> {
        let b = block.0 as usize;
        if b >= self.total || !state.reserved[b] {
            return Err(Error::Sink {
                block,
                layer,
                what: "block is not reserved",
            });
        }
        if layer >= self.layout.layers {
            return Err(Error::Sink {
                block,
                layer,
                what: "layer out of range",
            });
        }
        let bl = self.layout.bytes_per_block_layer();
        let start = (b * self.layout.layers as usize + layer as usize) * bl;
        Ok(start..start + bl)
    }
}

impl BlockSink for ArenaPool {
    fn layout(&self) -> KvLayout {
        self.layout
    }

    fn reserve(&self, n: usize) -> Result<Vec<BlockId>> {
        let mut state = self.lock();
        let free = state.free.len();
        if n > free {
            return Err(Error::PoolExhausted { requested: n, free });
        }
        let mut blocks = state.free.split_off(free - n);
        // Ascending: a fresh pool's reservation is one run of consecutive blocks, which a
        // device pool fills with one copy per frame (`write_layers_device`).
        blocks.reverse();
        for b in &blocks {
            state.reserved[b.0 as usize] = true;
        }
        Ok(blocks)
    }

    fn write_layer(&self, block: BlockId, layer: u32, bytes: &[u8]) -> Result<()> {
        let mut state = self.lock();
        let range = self.block_range(&state, block, layer)?;
        if bytes.len() != range.len() {
            return Err(Error::Sink {
                block,
                layer,
                what: "write is not exactly one block-layer",
            });
        }
        state.data.write(range.start, bytes).map_err(|d| device_err(block, layer, d))?;
        self.layer_writes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// One device copy per run of consecutive block IDs (a fresh pool hands them out in
    /// runs): a run's block-layers are a block apart.
    fn write_layers_device(&self, blocks: &[BlockId], layer: u32, bytes: DeviceBytes<'_>) -> Result<bool> {
        let state = self.lock();
        let Storage::Device(mem) = &state.data else { return Ok(false) };
        if mem.label != bytes.memory.label {
            return Ok(false);
        }
        let bl = self.layout.bytes_per_block_layer();
        if Some(bytes.len) != blocks.len().checked_mul(bl) {
            return Err(Error::Sink {
                block: blocks.first().copied().unwrap_or(BlockId(0)),
                layer,
                what: "write is not exactly one block-layer per block",
            });
        }
        let mut starts = Vec::with_capacity(blocks.len());
        for &b in blocks {
            starts.push(self.block_range(&state, b, layer)?.start);
        }
        let mut i = 0;
        while i < blocks.len() {
            let run = 1 + blocks[i + 1..].iter().zip(&blocks[i..]).take_while(|(next, prev)| next.0 == prev.0.wrapping_add(1)).count();
            let dst = mem.device_addr + starts[i] as u64;
            bytes
                .memory
                .copy
                .copy_rows_to_device(bytes.offset + i * bl, bl, run, dst, self.layout.bytes_per_block())
                .map_err(|d| device_err(blocks[i], layer, d))?;
            i += run;
        }
        self.layer_writes.fetch_add(blocks.len() as u64, Ordering::Relaxed);
        Ok(true)
    }

    fn release(&self, blocks: &[BlockId]) {
        let mut state = self.lock();
        for &b in blocks {
            let i = b.0 as usize;
            if i < self.total && state.reserved[i] {
                state.reserved[i] = false;
                state.free.push(b);
            } else {
                self.double_releases.fetch_add(1, Ordering::Relaxed);
                tracing::error!(block = b.0, "release of a block that is not reserved");
            }
        }
    }

    fn free_blocks(&self) -> usize {
        self.lock().free.len()
    }
}

impl BlockSource for ArenaPool {
    fn layout(&self) -> KvLayout {
        self.layout
    }

    fn read_layer(&self, block: BlockId, layer: u32, out: &mut [u8]) -> Result<()> {
        let state = self.lock();
        let range = self.block_range(&state, block, layer)?;
        if out.len() != range.len() {
            return Err(Error::Sink {
                block,
                layer,
                what: "read is not exactly one block-layer",
            });
        }
        state.data.read(range.start, out).map_err(|d| device_err(block, layer, d))
    }
}

/// splitmix64-seeded xorshift bytes: cheap, reproducible test data.
pub fn fill_pseudo_random(out: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    x |= 1;
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    let rem = chunks.into_remainder();
    let n = rem.len();
    rem.copy_from_slice(&x.to_le_bytes()[..n]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::KvDtype;
    use proptest::prelude::*;

    #[test]
    fn a_device_pool_keeps_its_blocks_in_device_memory() {
        use crate::transport::device_memory::host_device::HostDevice;
        let l = tiny();
        let (small, _) = HostDevice::memory("cuda:0", ArenaPool::bytes_for(l, 4).unwrap() - 1);
        assert!(matches!(ArenaPool::on_device(l, 4, small), Err(Error::InvalidArgument { .. })));
        let (mem, dev) = HostDevice::memory("cuda:0", ArenaPool::bytes_for(l, 4).unwrap());
        let base = mem.device_addr;
        let pool = ArenaPool::on_device(l, 4, mem).unwrap();
        let b = pool.reserve(2).unwrap();
        let bl = l.bytes_per_block_layer();
        pool.write_layer(b[1], 2, &vec![9u8; bl]).unwrap();
        let mut out = vec![0u8; bl];
        pool.read_layer(b[1], 2, &mut out).unwrap();
        assert_eq!(out, vec![9u8; bl]);
        assert_eq!(dev.host_reads.load(Ordering::SeqCst), bl as u64);
        // Addresses are the blocks' own (block-major, a block's layers contiguous).
        assert_eq!(pool.block_device_addr(b[1]).unwrap(), Some(base + (b[1].0 as usize * l.bytes_per_block()) as u64));
        assert!(pool.block_device_addr(BlockId(3)).is_err(), "a free block has no address to hand out");
        assert!(pool.device_memory().is_some());
        assert_eq!(ArenaPool::new(l, 1).unwrap().device_memory(), None);
        // A device write of the wrong length, or into a free block, is refused.
        let (src, src_dev) = HostDevice::memory("cuda:0", 4 * bl);
        let bytes = |len| DeviceBytes { memory: &src, offset: 0, len };
        assert!(pool.write_layers_device(&[b[0]], 0, bytes(bl - 2)).is_err());
        assert!(pool.write_layers_device(&[BlockId(3)], 0, bytes(bl)).is_err());
        assert!(pool.write_layers_device(&[b[0], BlockId(3)], 0, bytes(2 * bl)).is_err());
        // Runs of consecutive blocks go in one copy each: [hi, lo] is two runs ...
        let (lo, hi) = if b[0].0 < b[1].0 { (b[0], b[1]) } else { (b[1], b[0]) };
        assert_eq!(hi.0, lo.0 + 1);
        let rows: Vec<u8> = (0..2 * bl).map(|i| (i / bl) as u8 + 1).collect();
        src.copy.write(0, &rows).unwrap();
        assert!(pool.write_layers_device(&[hi, lo], 1, bytes(2 * bl)).unwrap());
        assert_eq!(src_dev.device_copies.load(Ordering::SeqCst), 2);
        let mut out = vec![0u8; bl];
        pool.read_layer(hi, 1, &mut out).unwrap();
        assert_eq!(out, vec![1u8; bl]);
        pool.read_layer(lo, 1, &mut out).unwrap();
        assert_eq!(out, vec![2u8; bl]);
        // ... and [lo, hi] one.
        assert!(pool.write_layers_device(&[lo, hi], 2, bytes(2 * bl)).unwrap());
        assert_eq!(src_dev.device_copies.load(Ordering::SeqCst), 3);
        pool.read_layer(hi, 2, &mut out).unwrap();
        assert_eq!(out, vec![2u8; bl]);
    }

    fn tiny() -> KvLayout {
        KvLayout {
            layers: 3,
            block_tokens: 2,
            kv_heads: 1,
            head_dim: 4,
            dtype: KvDtype::F16,
        }
    }

    #[test]
    fn writes_only_to_reserved_blocks() {
        let pool = ArenaPool::new(tiny(), 4).unwrap();
        let bl = tiny().bytes_per_block_layer();
        assert!(pool.write_layer(BlockId(0), 0, &vec![1; bl]).is_err());
        let b = pool.reserve(2).unwrap();
        pool.write_layer(b[0], 2, &vec![7; bl]).unwrap();
        assert!(pool.write_layer(b[0], 3, &vec![7; bl]).is_err());
        assert!(pool.write_layer(b[0], 1, &vec![7; bl - 1]).is_err());
        let mut out = vec![0; bl];
        pool.read_layer(b[0], 2, &mut out).unwrap();
        assert_eq!(out, vec![7; bl]);
        pool.release(&b);
        pool.release(&b);
        assert_eq!(pool.double_releases(), 2);
        assert_eq!(pool.free_blocks(), 4);
    }

    proptest! {
        #[test]
        fn free_list_stays_consistent(ops in prop::collection::vec((any::<bool>(), 0usize..5), 0..64)) {
            let pool = ArenaPool::new(tiny(), 8).unwrap();
            let mut held: Vec<Vec<BlockId>> = Vec::new();
            for (reserve, n) in ops {
                if reserve {
                    match pool.reserve(n) {
                        Ok(b) => { prop_assert_eq!(b.len(), n); held.push(b) }
                        Err(Error::PoolExhausted { requested, free }) => {
                            prop_assert!(requested > free)
                        }
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                } else if let Some(b) = held.pop() {
                    pool.release(&b);
                }
                let out: usize = held.iter().map(Vec::len).sum();
                prop_assert_eq!(pool.free_blocks() + out, 8);
            }
            let mut all: Vec<u32> = held.concat().iter().map(|b| b.0).collect();
            all.sort_unstable();
            all.dedup();
            prop_assert_eq!(all.len(), held.iter().map(Vec::len).sum::<usize>());
            prop_assert_eq!(pool.double_releases(), 0);
        }
    }
}
