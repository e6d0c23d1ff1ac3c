//! Fuzzes the frame decoder and the grant decoder with arbitrary bytes: they must never
//! panic, never consume past the input, and never allocate more than the checked limits.
//!
//! Run: `cd kv-transport/fuzz && cargo +nightly fuzz run frame_decoder -- -max_total_time=60`

#![no_main]

use baton_kv_transport::handoff::frame::{decode, FrameKind, FrameLimits, HEADER_LEN, TRAILER_LEN};
use baton_kv_transport::handoff::Grant;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // A small cap so the fuzzer reaches both sides of the length check.
    let limits = FrameLimits { max_payload: 1 << 16 };
    let mut rest = data;
    while let Ok(Some((frame, used))) = decode(rest, &limits) {
        assert!(used >= HEADER_LEN + TRAILER_LEN && used <= rest.len());
        if frame.header.kind == FrameKind::Data {
            assert!(frame.payload.len() <= limits.max_payload as usize);
        }
        let _ = frame.verify();
        let _ = frame.open_layout();
        let _ = frame.failure();
        rest = &rest[used..];
    }
    let _ = Grant::from_bytes(data);
});
