//! Slot rings and credits: the pure bookkeeping of the staging-ring data path.
//!
//! Owns: [`RingGeometry`] (how a registered region is cut into rings and slots),
//! [`RingPool`] (which rings are leased to live links) and [`SendWindow`] (when a sender may
//! write the next frame). No verbs here, so all of it is tested without a device.
//! Invariants: frame `seq` always lives in slot `seq % slots`; a sender never has more than
//! `slots` frames that the receiver has not consumed, nor more than `slots` writes whose
//! completion it has not seen, so neither end's slot is overwritten while in use and the
//! receiver's posted receives never run out (no RNR).

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// How one region is cut: `rings` rings of `slots` slots of `slot_bytes` bytes, back to back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingGeometry {
    pub rings: u32,
    pub slots: u32,
    pub slot_bytes: u32,
}

impl RingGeometry {
    /// Checks the numbers and that the region's size fits in memory.
    pub fn new(rings: u32, slots: u32, slot_bytes: u32) -> Result<Self> {
        let g = RingGeometry {
            rings,
            slots,
            slot_bytes,
        };
        if rings == 0 || slots == 0 || slot_bytes == 0 {
            return Err(Error::InvalidArgument {
                what: "RDMA rings, slots and slot size must be non-zero",
            });
        }
        g.region_bytes().ok_or(Error::InvalidArgument {
            what: "RDMA ring region size overflows",
        })?;
        Ok(g)
    }

    pub fn ring_bytes(&self) -> usize {
        self.slots as usize * self.slot_bytes as usize
    }

    pub fn region_bytes(&self) -> Option<usize> {
        (self.slots as usize)
            .checked_mul(self.slot_bytes as usize)?
            .checked_mul(self.rings as usize)
    }

    /// Offset of ring `ring` from the start of the region.
    pub fn ring_offset(&self, ring: u32) -> usize {
        ring as usize * self.ring_bytes()
    }

    /// Offset of the slot frame `seq` uses, from the start of its ring.
    pub fn slot_offset(&self, seq: u64) -> usize {
        (seq % u64::from(self.slots)) as usize * self.slot_bytes as usize
    }
}

/// Rings free for new links. Cheap to clone; a [`RingLease`] gives its ring back on drop.
#[derive(Clone)]
pub struct RingPool {
    free: Arc<Mutex<Vec<u32>>>,
}

/// One ring held by one link.
pub struct RingLease {
    pub index: u32,
    free: Arc<Mutex<Vec<u32>>>,
}

impl RingPool {
    pub fn new(rings: u32) -> Self {
        RingPool {
            // Popped from the end: ring 0 first.
            free: Arc::new(Mutex::new((0..rings).rev().collect())),
        }
    }

    /// A free ring, or `None` when every ring is leased.
    pub fn lease(&self) -> Option<RingLease> {
        let index = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
        Some(RingLease {
            index,
            free: self.free.clone(),
        })
    }

    pub fn available(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for RingLease {
    fn drop(&mut self) {
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.index);
    }
}

/// The sender's view of one link's ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendWindow {
    slots: u64,
    /// Writes posted (the next frame's sequence number).
    posted: u64,
    /// Writes whose successful completion was polled (in order: one RC send queue).
    completed: u64,
    /// Frames the receiver reported consumed.
    consumed: u64,
}

impl SendWindow {
    pub fn new(slots: u32) -> Self {
        SendWindow {
            slots: u64::from(slots),
            posted: 0,
            completed: 0,
            consumed: 0,
        }
    }

    /// The sequence number the next frame may use, if both its local slot (previous write
    /// from it completed) and the remote slot (receiver consumed the frame in it) are free.
    pub fn next(&self) -> Option<u64> {
        let local_free = self.posted < self.completed + self.slots;
        let remote_free = self.posted < self.consumed + self.slots;
        (local_free && remote_free).then_some(self.posted)
    }

    pub fn posted(&mut self) {
        self.posted += 1;
    }

    /// One write completed successfully.
    pub fn completed(&mut self) -> Result<()> {
        if self.completed >= self.posted {
            return Err(Error::FrameMalformed {
                what: "RDMA completion for a write that was not posted",
            });
        }
        self.completed += 1;
        Ok(())
    }

    /// A credit from the receiver: `consumed` frames so far. Never moves backwards, and can
    /// never acknowledge a frame that was not written.
    pub fn credit(&mut self, consumed: u64) -> Result<()> {
        if consumed > self.posted {
            return Err(Error::FrameMalformed {
                what: "RDMA credit for frames that were not sent",
            });
        }
        self.consumed = self.consumed.max(consumed);
        Ok(())
    }

    /// Writes posted and not yet seen completing.
    pub fn in_flight(&self) -> u64 {
        self.posted - self.completed
    }

    pub fn completed_count(&self) -> u64 {
        self.completed
    }
}

/// The receiver's view of one link's ring: which frames are done with their slots and how
/// many of them the sender has been credited. Frames may be done out of order (a frame left
/// in a device ring is done when the receiver drops it); credits are cumulative, so they
/// only ever cover an unbroken run from the first frame.
#[derive(Debug, Default)]
pub struct SlotCredits {
    /// Frames credited back (every frame below is done).
    credited: u64,
    /// Done frames at or above `credited`, waiting for the gap below them.
    done: std::collections::BTreeSet<u64>,
}

impl SlotCredits {
    /// Frame `seq` is done with its slot. A frame already credited changes nothing.
    pub fn done(&mut self, seq: u64) {
        if seq >= self.credited {
            self.done.insert(seq);
        }
    }

    /// Credits every frame done in an unbroken run from the last credit: the new cumulative
    /// count, or `None` when nothing new can be credited.
    pub fn advance(&mut self) -> Option<u64> {
        let before = self.credited;
        while self.done.remove(&self.credited) {
            self.credited += 1;
        }
        (self.credited > before).then_some(self.credited)
    }

    pub fn credited(&self) -> u64 {
        self.credited
    }
}

/// Immediate data carried by the write of frame `seq` (big-endian on the wire, as verbs
/// defines `imm_data`); the receiver checks it against the sequence it expects.
pub fn imm_for(seq: u64) -> u32 {
    seq as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_offsets() {
        let g = RingGeometry::new(3, 4, 100).unwrap();
        assert_eq!(g.ring_bytes(), 400);
        assert_eq!(g.region_bytes(), Some(1200));
        assert_eq!(g.ring_offset(2), 800);
        assert_eq!(g.slot_offset(0), 0);
        assert_eq!(g.slot_offset(5), 100);
        assert_eq!(g.slot_offset(7), 300);
        assert!(RingGeometry::new(0, 4, 100).is_err());
        assert!(RingGeometry::new(u32::MAX, u32::MAX, u32::MAX).is_err());
    }

    #[test]
    fn leases_come_back_on_drop() {
        let pool = RingPool::new(2);
        let a = pool.lease().unwrap();
        let b = pool.lease().unwrap();
        assert_ne!(a.index, b.index);
        assert!(pool.lease().is_none());
        drop(a);
        assert_eq!(pool.available(), 1);
        let c = pool.lease().unwrap();
        assert!(c.index < 2);
    }

    #[test]
    fn window_waits_for_both_credit_and_completion() {
        let mut w = SendWindow::new(2);
        for seq in 0..2 {
            assert_eq!(w.next(), Some(seq));
            w.posted();
        }
        assert_eq!(w.next(), None, "ring full");
        // The receiver consumed frame 0 but the local write is not seen complete yet.
        w.credit(1).unwrap();
        assert_eq!(w.next(), None, "local slot 0 still in use");
        w.completed().unwrap();
        assert_eq!(w.next(), Some(2));
        w.posted();
        // Completions without credits do not open the window.
        w.completed().unwrap();
        w.completed().unwrap();
        assert_eq!(w.next(), None);
        assert!(w.completed().is_err(), "more completions than writes");
        // Credits are cumulative and never go back.
        w.credit(3).unwrap();
        w.credit(2).unwrap();
        assert_eq!(w.next(), Some(3));
        assert!(w.credit(4).is_err(), "credit past what was sent");
        assert_eq!(w.in_flight(), 0);
    }

    #[test]
    fn credits_cover_only_an_unbroken_run_of_done_frames() {
        let mut c = SlotCredits::default();
        assert_eq!(c.advance(), None);
        c.done(0);
        assert_eq!(c.advance(), Some(1));
        // Frame 2 done before frame 1 (still held by the receiver): no credit past 1.
        c.done(2);
        assert_eq!(c.advance(), None);
        assert_eq!(c.credited(), 1);
        c.done(1);
        assert_eq!(c.advance(), Some(3), "1 and 2 credited together");
        // A frame already credited, or done twice, changes nothing.
        c.done(0);
        c.done(3);
        c.done(3);
        assert_eq!(c.advance(), Some(4));
        assert_eq!(c.advance(), None);
    }

    #[test]
    fn imm_wraps_with_sequence() {
        assert_eq!(imm_for(5), 5);
        assert_eq!(imm_for((1 << 32) + 5), 5);
    }
}
