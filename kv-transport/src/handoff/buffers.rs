//! Recycled frame payload buffers.
//!
//! A GiB of KV moves as about a thousand 1 MiB frames. Allocated afresh, each frame is a
//! new `mmap` from glibc whose pages the kernel faults in and zeroes on first write, and
//! an `munmap` when it drops: on both the sending and the receiving side. Here a frame
//! borrows a buffer and gives it back when the last `Bytes` of its payload drops,
//! wherever that happens (quinn keeps sent data until the peer acknowledges it).

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;

/// Payloads under this size (control frames, a few blocks) are plain allocations:
/// glibc serves them from its free lists, and they would tie up a frame-sized buffer.
const MIN_POOLED: usize = 64 << 10;

/// Buffers waiting for reuse, up to `max_bytes` of capacity in all.
pub struct BufferPool {
    free: Mutex<Free>,
    max_bytes: usize,
}

#[derive(Default)]
struct Free {
    buffers: Vec<Vec<u8>>,
    bytes: usize,
}

/// A buffer of the pool; back to it on drop.
pub struct PooledBuf {
    buf: Vec<u8>,
    pool: Arc<BufferPool>,
}

impl BufferPool {
    pub fn new(max_bytes: usize) -> Arc<Self> {
        Arc::new(BufferPool { free: Mutex::new(Free::default()), max_bytes })
    }

    /// The process's pool for frame payloads: 64 MiB kept at most, about the frames one
    /// fast link has in flight.
    pub fn frames() -> &'static Arc<BufferPool> {
        static FRAMES: OnceLock<Arc<BufferPool>> = OnceLock::new();
        FRAMES.get_or_init(|| BufferPool::new(64 << 20))
    }

    /// A buffer of exactly `len` bytes. A recycled one holds an earlier frame's bytes:
    /// the caller overwrites all of it.
    pub fn take(self: &Arc<Self>, len: usize) -> PooledBuf {
        if len < MIN_POOLED {
            return PooledBuf { buf: vec![0; len], pool: self.clone() };
        }
        let recycled = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            match free.buffers.iter().position(|b| b.capacity() >= len) {
                Some(i) => {
                    let b = free.buffers.swap_remove(i);
                    free.bytes -= b.capacity();
                    Some(b)
                }
                None => {
                    // None fits: give up the smallest, so that buffers too small for
                    // the frames now in use do not hold the pool's budget forever.
                    if let Some(i) = (0..free.buffers.len()).min_by_key(|&i| free.buffers[i].capacity()) {
                        let small = free.buffers.swap_remove(i);
                        free.bytes -= small.capacity();
                    }
                    None
                }
            }
        };
        let mut buf = recycled.unwrap_or_default();
        buf.resize(len, 0); // a recycled buffer only shrinks here: nothing is written
        PooledBuf { buf, pool: self.clone() }
    }

    /// Capacity held for reuse, in bytes.
    pub fn kept_bytes(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).bytes
    }
}

impl PooledBuf {
    /// The payload as `Bytes`; the buffer returns to the pool when the last clone drops.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if buf.capacity() < MIN_POOLED {
            return;
        }
        let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.bytes + buf.capacity() <= self.pool.max_bytes {
            free.bytes += buf.capacity();
            free.buffers.push(buf);
        }
    }
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_payload_returns_its_buffer_for_the_next_frame() {
        let pool = BufferPool::new(4 << 20);
        let mut b = pool.take(1 << 20);
        b[0] = 7;
        let ptr = b.as_ptr();
        let bytes = b.freeze();
        let clone = bytes.clone();
        drop(bytes);
        assert_eq!(pool.kept_bytes(), 0, "a clone still holds it");
        drop(clone);
        assert_eq!(pool.kept_bytes(), 1 << 20);
        let again = pool.take(512 << 10);
        assert_eq!((again.as_ptr(), again.len()), (ptr, 512 << 10), "the same allocation, shortened");
        assert_eq!(pool.kept_bytes(), 0);
    }

    #[test]
    fn small_buffers_make_way_for_the_frames_in_use() {
        let pool = BufferPool::new(2 << 20);
        drop((pool.take(100 << 10), pool.take(200 << 10)));
        assert_eq!(pool.kept_bytes(), 300 << 10);
        drop(pool.take(1 << 20)); // fits neither: the 100 KiB one goes, the 1 MiB one stays
        assert_eq!(pool.kept_bytes(), (200 << 10) + (1 << 20));
        drop(pool.take(1 << 20));
        assert_eq!(pool.kept_bytes(), (200 << 10) + (1 << 20), "reused, not allocated again");
    }

    #[test]
    fn control_sized_payloads_are_not_pooled() {
        let pool = BufferPool::new(2 << 20);
        drop(pool.take(1 << 20));
        let small = pool.take(20);
        assert_eq!((small.len(), pool.kept_bytes()), (20, 1 << 20), "the frame-sized buffer stays for frames");
        drop(small);
        assert_eq!(pool.kept_bytes(), 1 << 20);
    }

    #[test]
    fn the_pool_keeps_no_more_than_its_cap() {
        let pool = BufferPool::new(3 << 20);
        let bufs: Vec<_> = (0..5).map(|_| pool.take(1 << 20)).collect();
        drop(bufs);
        assert_eq!(pool.kept_bytes(), 3 << 20);
        let reused = pool.take(512 << 10);
        assert_eq!(reused.len(), 512 << 10);
        assert_eq!(pool.kept_bytes(), 2 << 20);
    }
}
