//! Codec tests: round trips, incremental decoding, and property tests that arbitrary input
//! never panics, never over-allocates, and that corruption is always caught.

use super::*;
use proptest::prelude::*;

fn arb_kind() -> impl Strategy<Value = FrameKind> {
    prop_oneof![
        Just(FrameKind::Open),
        Just(FrameKind::Data),
        Just(FrameKind::Done),
        Just(FrameKind::Cancel),
        Just(FrameKind::Completed),
        Just(FrameKind::Failed),
    ]
}

fn arb_frame() -> impl Strategy<Value = Frame> {
    (
        arb_kind(),
        any::<u64>(),
        any::<u64>(),
        any::<[u32; 4]>(),
        prop::collection::vec(any::<u8>(), 0..2048),
    )
        .prop_map(|(kind, r, e, [layer, first, count, aux], payload)| {
            let mut h = FrameHeader::new(kind, ReservationId(r), Epoch(e));
            h.layer = layer;
            h.first_block = first;
            h.block_count = count;
            h.aux = aux;
            let payload = match kind {
                FrameKind::Data => payload,
                FrameKind::Open => payload
                    .iter()
                    .copied()
                    .chain(std::iter::repeat(0))
                    .take(OPEN_PAYLOAD_LEN)
                    .collect(),
                _ => Vec::new(),
            };
            Frame::new(h, Bytes::from(payload))
        })
}

fn encode(frames: &[Frame]) -> Vec<u8> {
    let mut out = BytesMut::new();
    for f in frames {
        f.encode_to(&mut out);
    }
    out.to_vec()
}

#[test]
fn open_frame_carries_the_layout() {
    let layout = KvLayout::smollm2_135m(KvDtype::Bf16);
    let f = Frame::open(ReservationId(3), Epoch(9), &layout, 2..30, 17);
    let bytes = encode(std::slice::from_ref(&f));
    let (back, used) = decode(&bytes, &FrameLimits::default()).unwrap().unwrap();
    assert_eq!(used, bytes.len());
    assert!(back.verify());
    assert_eq!(back.open_layout().unwrap(), layout);
    assert_eq!((back.header.layer, back.header.aux, back.header.block_count), (2, 30, 17));
}

#[test]
fn oversized_payload_is_rejected_before_reading_it() {
    let mut h = FrameHeader::new(FrameKind::Data, ReservationId(1), Epoch(1));
    h.payload_len = u32::MAX;
    let bytes = h.encode();
    let err = decode(&bytes, &FrameLimits::default()).unwrap_err();
    assert_eq!(err.label(), "frame_too_large");
    let mut h = FrameHeader::new(FrameKind::Done, ReservationId(1), Epoch(1));
    h.payload_len = 1;
    assert_eq!(decode(&h.encode(), &FrameLimits::default()).unwrap_err().label(), "frame_too_large");
}

#[test]
fn bad_magic_version_kind_and_flags_are_rejected() {
    let good = FrameHeader::new(FrameKind::Done, ReservationId(1), Epoch(1)).encode();
    let limits = FrameLimits::default();
    for (i, v, kind) in [
        (0, b'X', "frame_malformed"),
        (4, 2, "unsupported_version"),
        (5, 0, "frame_malformed"),
        (5, 7, "frame_malformed"),
        (6, 1, "frame_malformed"),
    ] {
        let mut b = good;
        b[i] = v;
        assert_eq!(FrameHeader::decode(&b, &limits).unwrap_err().label(), kind);
    }
}

#[tokio::test]
async fn async_reader_matches_sync_decoder_and_sees_clean_eof() {
    let frames: Vec<Frame> = (0..5u8)
        .map(|i| {
            let mut h = FrameHeader::new(FrameKind::Data, ReservationId(1), Epoch(2));
            h.layer = u32::from(i);
            Frame::new(h, Bytes::from(vec![i; 1000 * usize::from(i)]))
        })
        .collect();
    let bytes = encode(&frames);
    let mut r = &bytes[..];
    for f in &frames {
        let got = read_frame(&mut r, &FrameLimits::default()).await.unwrap().unwrap();
        assert_eq!(&got, f);
    }
    assert!(read_frame(&mut r, &FrameLimits::default()).await.unwrap().is_none());
    // A stream cut inside a header is an error, not a clean end.
    let mut cut = &bytes[..10];
    assert!(read_frame(&mut cut, &FrameLimits::default()).await.is_err());
}

proptest! {
    #[test]
    fn round_trip(frames in prop::collection::vec(arb_frame(), 1..6)) {
        let bytes = encode(&frames);
        let mut at = 0;
        for f in &frames {
            let (got, used) = decode(&bytes[at..], &FrameLimits::default()).unwrap().unwrap();
            prop_assert!(got.verify());
            prop_assert_eq!(&got, f);
            at += used;
        }
        prop_assert_eq!(at, bytes.len());
    }

    #[test]
    fn every_prefix_asks_for_more(f in arb_frame()) {
        let bytes = encode(std::slice::from_ref(&f));
        for cut in 0..bytes.len() {
            prop_assert!(decode(&bytes[..cut], &FrameLimits::default()).unwrap().is_none());
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..4096), max in 0u32..8192) {
        let limits = FrameLimits { max_payload: max };
        let mut rest = &bytes[..];
        while let Ok(Some((f, used))) = decode(rest, &limits) {
            prop_assert!(used >= HEADER_LEN + TRAILER_LEN && used <= rest.len());
            if f.header.kind == FrameKind::Data {
                prop_assert!(f.payload.len() <= max as usize);
            } else {
                prop_assert!(f.payload.len() <= OPEN_PAYLOAD_LEN);
            }
            let _ = f.verify();
            let _ = f.open_layout();
            rest = &rest[used..];
        }
    }

    #[test]
    fn arbitrary_bytes_after_a_valid_header_never_panic(
        f in arb_frame(), tail in prop::collection::vec(any::<u8>(), 0..256)
    ) {
        let mut bytes = f.header.encode().to_vec();
        bytes.extend_from_slice(&tail);
        let _ = decode(&bytes, &FrameLimits::default());
    }

    #[test]
    fn any_single_bit_flip_is_detected(f in arb_frame(), bit in any::<prop::sample::Index>()) {
        let mut bytes = encode(std::slice::from_ref(&f));
        let i = bit.index(bytes.len() * 8);
        bytes[i / 8] ^= 1 << (i % 8);
        match decode(&bytes, &FrameLimits::default()) {
            // Rejected by header validation, or needs more bytes (a grown length).
            Err(_) | Ok(None) => {}
            Ok(Some((got, _))) => prop_assert!(!got.verify(), "flip at bit {} went unnoticed", i),
        }
    }
}
