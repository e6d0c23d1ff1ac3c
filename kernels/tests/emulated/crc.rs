//! The CRC-32 kernels (crc.cu) against `crc32fast`, the frame checksum the KV transport
//! computes on the host: every length from empty to past a 1 MiB frame, bytes starting at
//! every alignment, launched from the plan the `DmaBuf` launches from.

use baton_kernels::cuda::plan::{self, CRC_MAX_BLOCKS};
use baton_kernels::emu;

use super::launch;
use crate::support::random_bytes;

/// The two launches of `plan::crc32` over `data`, as the GPU runs them.
fn emu_crc32(data: &[u8]) -> u32 {
    let p = plan::crc32(data.len());
    let mut partials = vec![0u32; CRC_MAX_BLOCKS];
    let mut out = [0u32; 1];
    let blocks = p.chunks.grid.0 as i32;
    unsafe {
        emu::crc32_chunks(&launch(p.chunks), data.as_ptr(), data.len() as u64, p.chunk, partials.as_mut_ptr());
        emu::crc32_finish(&launch(p.finish), partials.as_ptr(), blocks, out.as_mut_ptr());
    }
    out[0]
}

#[test]
fn crc_kernel_matches_crc32fast_at_every_length_and_alignment() {
    // Past the longest length by 8, so every start offset 0..8 has the bytes after it.
    let lens = [0usize, 1, 3, 4, 5, 255, 256, 4096, 4097, 16_383, 16_384, 16_385, (1 << 20) + 44];
    let buf = random_bytes(lens[lens.len() - 1] + 8, 1);
    for &len in &lens {
        for start in [0usize, 1, 2, 3, 5, 7] {
            let data = &buf[start..start + len];
            assert_eq!(emu_crc32(data), crc32fast::hash(data), "{len} bytes at offset {start} (address {:p})", data.as_ptr());
        }
    }
    // Known answers: the check value of CRC-32/ISO-HDLC, and the empty message.
    assert_eq!(emu_crc32(b"123456789"), 0xCBF4_3926);
    assert_eq!(emu_crc32(b""), 0);
}

/// Lengths around the chunk and block edges of the plan (one thread's chunk, a block of
/// chunks, a chunk past the first block) and many small ones, each with other bytes.
#[test]
fn crc_kernel_matches_crc32fast_around_chunk_edges() {
    let threads = plan::CRC_THREADS as usize;
    let chunk = plan::CRC_MIN_CHUNK;
    let mut lens: Vec<usize> = (0..70).collect();
    for edge in [chunk, threads * chunk, 3 * threads * chunk] {
        lens.extend([edge - 1, edge, edge + 1]);
    }
    for (i, &len) in lens.iter().enumerate() {
        let data = random_bytes(len + 3, 100 + i as u64);
        let data = &data[3..];
        assert_eq!(emu_crc32(data), crc32fast::hash(data), "{len} bytes");
    }
    // All zeros and all ones: the start value's term alone, and bytes that cancel it.
    for len in [1usize, 64, 4097] {
        for fill in [0u8, 0xff] {
            let data = vec![fill; len];
            assert_eq!(emu_crc32(&data), crc32fast::hash(&data), "{len} bytes of {fill:#x}");
        }
    }
}
