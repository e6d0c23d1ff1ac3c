//! Index lists moved to the device through page-locked memory into reused device buffers:
//! the block ids of a KV pack or unpack and an eager step's tokens and logit rows (the
//! backend's one [`PinnedIds`], through [`Uploaded`]), and the index arrays a forward pass
//! repeats at every layer (attention's, rope's positions, kv_write's slots: a
//! [`ReusedUpload`] each, since a layer's kernels read several at once).
//!
//! `memcpy_stod` from a `Vec` costs, per call, a device allocation, its free (without
//! stream-ordered allocation a free first synchronizes the whole stream) and a copy from
//! pageable memory, which the driver may finish before returning, after the stream's queued
//! work. A pipelined export paid that once per layer, an import once per received frame, a
//! forward pass three times more. A [`PinnedIds`] instead has:
//!
//! - A ring of page-locked host buffers ([`HostBuf`], whose pointer is taken once, at
//!   allocation), made on first use, each with an event recorded after the copy that reads
//!   it. A slot is refilled only once that event completed: the least recently used
//!   completed slot is taken, else the least recently used one after waiting on its event
//!   (that one copy, never the whole stream). [`IdRing`] is this bookkeeping, without CUDA.
//! - One device buffer, grown (never shrunk) when a longer list comes, and the words it
//!   holds: a list equal to the last one is not copied again (a forward pass exports the
//!   same blocks at every layer; an import's frames repeat a run's blocks layer by layer).
//!
//! Why one device buffer is enough: every copy into it and every kernel that reads it are
//! queued on the backend's one compute stream, and [`Uploaded`] keeps the lock from the
//! copy until the caller's launch is queued (a [`ReusedUpload`] is used under the scratch
//! lock likewise), so no other thread's copy lands in between. A stream runs its work in
//! order: the next copy into the buffer starts only after every kernel queued before it,
//! the readers of the previous list included, has finished. A grown buffer's old allocation
//! is freed in stream order too (`cuMemFreeAsync`, or `cuMemFree` after a stream
//! synchronize where the driver lacks it).
//!
//! Nothing is uploaded during a CUDA graph capture (callers ask the `CaptureGuard` first,
//! as for any pageable upload, and the capture is thrown away): a captured copy would read
//! its slot again at every replay, long after the slot was refilled. A captured step reads
//! its inputs from its own staged words instead (`graph`, `step_inputs`).

use std::sync::{Arc, MutexGuard};

use cudarc::driver::{result, CudaEvent, CudaSlice, CudaStream, CudaView, DevicePtrMut, DriverError};

use super::fail;
use super::staging::HostBuf;
use crate::step::CaptureGuard;

/// Host slots of the backend's ring: uploads the host may queue ahead of the GPU before it
/// waits on the oldest (a forward pass with a pipelined export makes about three).
pub const SLOTS: usize = 8;
/// Words of the smallest slot or device buffer (4 KiB).
pub const MIN_WORDS: usize = 1024;

/// Words allocated for a list of `len` words: a power of two, so a slowly growing list
/// reallocates a few times, not at every call.
pub fn capacity_for(len: usize) -> usize {
    len.max(MIN_WORDS).next_power_of_two()
}

/// What one upload does before its copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub slot: usize,
    /// The slot's previous copy may still read it: wait on its event first.
    pub wait: bool,
    /// Reallocate the slot's host buffer to this many words (after the wait).
    pub grow_slot: Option<usize>,
    /// Reallocate the device buffer to this many words.
    pub grow_device: Option<usize>,
}

/// The ring's bookkeeping, without CUDA: which slot an upload goes through, what must
/// happen first, and which words the device buffer holds.
#[derive(Debug)]
pub struct IdRing {
    /// Words of each slot's host buffer (0: not made yet).
    slot_words: Vec<usize>,
    /// When each slot was last taken (0: never).
    last_use: Vec<u64>,
    uses: u64,
    device_words: usize,
    /// The list the device buffer holds (once its copy is queued).
    held: Option<Vec<u32>>,
}

impl IdRing {
    pub fn new(slots: usize) -> IdRing {
        assert!(slots > 0, "a ring of no slots");
        IdRing { slot_words: vec![0; slots], last_use: vec![0; slots], uses: 0, device_words: 0, held: None }
    }

    /// Whether the device buffer holds `words` (their copy is queued).
    pub fn holds(&self, words: &[u32]) -> bool {
        self.held.as_deref() == Some(words)
    }

    /// The upload of `words`, or `None` when the device buffer already holds them.
    /// `done(slot)` says whether the slot's last copy has completed (true for a slot
    /// never used). Until [`IdRing::uploaded`] the device buffer counts as holding nothing.
    pub fn plan(&mut self, words: &[u32], done: impl Fn(usize) -> bool) -> Option<Plan> {
        if self.holds(words) {
            return None;
        }
        self.held = None;
        let mut by_age: Vec<usize> = (0..self.slot_words.len()).collect();
        by_age.sort_by_key(|&s| self.last_use[s]);
        let (slot, wait) = match by_age.iter().find(|&&s| done(s)) {
            Some(&s) => (s, false),
            None => (by_age[0], true),
        };
        self.uses += 1;
        self.last_use[slot] = self.uses;
        let grow = |have: &mut usize| {
            (*have < words.len().max(1)).then(|| {
                *have = capacity_for(words.len());
                *have
            })
        };
        let grow_slot = grow(&mut self.slot_words[slot]);
        let grow_device = grow(&mut self.device_words);
        Some(Plan { slot, wait, grow_slot, grow_device })
    }

    /// A planned upload failed part way: `slot` and the device buffer are to be made again
    /// (whatever was allocated before the failure is dropped by the caller).
    pub fn failed(&mut self, slot: usize) {
        self.slot_words[slot] = 0;
        self.device_words = 0;
        self.held = None;
    }

    /// The copy of `words` into the device buffer is queued.
    pub fn uploaded(&mut self, words: &[u32]) {
        let held = self.held.get_or_insert_with(Vec::new);
        held.clear();
        held.extend_from_slice(words);
    }
}

/// A ring's host slots and events and its device buffer (see the module comment).
pub(super) struct PinnedIds {
    ring: IdRing,
    /// Each slot's host buffer and the event recorded after the last copy out of it.
    slots: Vec<Option<(HostBuf, CudaEvent)>>,
    device: Option<CudaSlice<u32>>,
    /// Why a slot is ordinary memory (page-locking failed), if one is.
    pub pageable_because: Option<String>,
}

impl PinnedIds {
    /// A ring of `slots` host buffers, each made on its first use.
    pub fn new(slots: usize) -> PinnedIds {
        PinnedIds { ring: IdRing::new(slots), slots: (0..slots).map(|_| None).collect(), device: None, pageable_because: None }
    }

    /// Whether the device buffer holds `words` (a copy of them is queued).
    pub fn holds(&self, words: &[u32]) -> bool {
        self.ring.holds(words)
    }

    /// The device buffer (at least as long as the last list), once a list was uploaded.
    pub fn device(&self) -> Option<&CudaSlice<u32>> {
        self.device.as_ref()
    }

    /// Queues the copy of `words` into the device buffer on `stream`, nothing when it holds
    /// them already. Not during a capture: the caller asked the capture guard.
    pub fn upload(&mut self, stream: &Arc<CudaStream>, words: &[u32]) -> Result<(), DriverError> {
        // The raw driver calls below need the context current on this thread, which
        // `memcpy_stod` used to make so itself.
        stream.context().bind_to_thread()?;
        let done = |s: usize| self.slots[s].as_ref().is_none_or(|(_, copied)| copied.is_complete());
        let Some(plan) = self.ring.plan(words, done) else { return Ok(()) };
        let queued = self.queue(stream, words, plan);
        if queued.is_err() {
            // Made again on the next upload: the slot once its event says its copy is done
            // (its buffer is kept until then), the device buffer freed in stream order now.
            self.ring.failed(plan.slot);
            self.device = None;
        }
        queued
    }

    fn queue(&mut self, stream: &Arc<CudaStream>, words: &[u32], plan: Plan) -> Result<(), DriverError> {
        // Until the copy is queued the device buffer holds no known list (`plan` forgot it).
        if plan.wait {
            if let Some((_, copied)) = &self.slots[plan.slot] {
                copied.synchronize()?;
            }
        }
        if let Some(n) = plan.grow_slot {
            // The old buffer's copy is done (waited above, or its event had completed).
            let ctx = stream.context();
            let event = match self.slots[plan.slot].take() {
                Some((_, event)) => event,
                None => ctx.new_event(None)?,
            };
            let host = HostBuf::new(ctx, n * 4, true).or_else(|e| {
                self.pageable_because.get_or_insert_with(|| format!("cuMemHostAlloc of {} KiB: {e:?}", n >> 8));
                HostBuf::new(ctx, n * 4, false)
            })?;
            self.slots[plan.slot] = Some((host, event));
        }
        if let Some(n) = plan.grow_device {
            // Freed in stream order, after the kernels queued on it. Not an allocation the
            // capture guard counts: no captured graph reads this buffer (nothing is uploaded
            // during a capture, so no kernel a graph keeps was given it).
            self.device = None;
            self.device = Some(stream.alloc_zeros::<u32>(n)?);
        }
        let (host, copied) = self.slots[plan.slot].as_mut().expect("a slot is made before its first copy");
        let bytes = std::mem::size_of_val(words);
        // SAFETY: a u32 slice viewed as its bytes (any bit pattern is a valid u8).
        let src = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), bytes) };
        host.as_mut_slice()[..bytes].copy_from_slice(src);
        let device = self.device.as_mut().expect("the device buffer is made before its first copy");
        let (dst, _guard) = device.device_ptr_mut(stream);
        // SAFETY: both buffers hold `words` (grown above); the slot is not written again
        // before its event completes, and the device buffer's readers are ordered by the stream.
        unsafe { result::memcpy_htod_async(dst, &host.as_slice()[..bytes], stream.cu_stream()) }?;
        copied.record(stream)?;
        self.ring.uploaded(words);
        Ok(())
    }
}

impl Drop for PinnedIds {
    fn drop(&mut self) {
        // No copy may still read a slot about to be freed.
        for (_, copied) in self.slots.iter().flatten() {
            let _ = copied.synchronize();
        }
    }
}

/// A list on the device, valid for kernels queued while this lives: it holds the lock
/// that keeps the next list out of the buffer until they are queued.
pub(super) struct Uploaded<'a> {
    ids: MutexGuard<'a, PinnedIds>,
    len: usize,
}

impl<'a> Uploaded<'a> {
    /// Queues `words` on `stream` through `ids`.
    pub fn new(mut ids: MutexGuard<'a, PinnedIds>, stream: &Arc<CudaStream>, words: &[u32]) -> Result<Uploaded<'a>, DriverError> {
        ids.upload(stream, words)?;
        Ok(Uploaded { ids, len: words.len() })
    }

    pub fn view(&self) -> CudaView<'_, u32> {
        self.ids.device().expect("uploaded").slice(..self.len)
    }
}

/// An index array kept on the device for the next call that asks for the same words,
/// each kind its own (a layer's kernels read several at once): a forward pass asks the
/// same indices of every layer (`AttentionPlan::index_words`, rope's positions,
/// kv_write's slots), so it uploads them once per pass, through page-locked slots.
pub(super) struct ReusedUpload(PinnedIds);

impl Default for ReusedUpload {
    fn default() -> Self {
        // Each list changes once per pass: the host waits, if ever, for the copy two passes back.
        ReusedUpload(PinnedIds::new(2))
    }
}

impl ReusedUpload {
    pub fn get(&mut self, stream: &Arc<CudaStream>, guard: &CaptureGuard, words: &[u32]) -> &CudaSlice<u32> {
        // During a capture (refused) the stale buffer is launched with; the capture is
        // thrown away. Only a first upload goes ahead there, so that there is a buffer.
        if !self.0.holds(words) && (guard.allow("index upload") || self.0.device().is_none()) {
            self.0.upload(stream, words).unwrap_or_else(|e| fail("uploading indices", e));
        }
        self.device()
    }

    /// The buffer of the last `get`: its words first, then stale ones.
    pub fn device(&self) -> &CudaSlice<u32> {
        self.0.device().expect("uploaded by get")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + seed).collect()
    }

    #[test]
    fn slots_go_round_while_their_copies_complete() {
        let mut r = IdRing::new(3);
        let mut taken = Vec::new();
        for i in 0..7 {
            let p = r.plan(&ids(10, i), |_| true).expect("a new list is copied");
            assert!(!p.wait);
            taken.push(p.slot);
            r.uploaded(&ids(10, i));
        }
        assert_eq!(taken, [0, 1, 2, 0, 1, 2, 0], "least recently used first");
    }

    #[test]
    fn a_busy_slot_is_skipped_and_waited_on_only_when_all_are_busy() {
        let mut r = IdRing::new(3);
        for i in 0..3 {
            r.plan(&ids(4, i), |_| true).unwrap();
            r.uploaded(&ids(4, i));
        }
        // Slot 0 (oldest) still copying: the next completed one in age order.
        let p = r.plan(&ids(4, 10), |s| s != 0).unwrap();
        assert_eq!((p.slot, p.wait), (1, false));
        r.uploaded(&ids(4, 10));
        // None completed: the oldest (0), after waiting on it.
        let p = r.plan(&ids(4, 11), |_| false).unwrap();
        assert_eq!((p.slot, p.wait), (0, true));
        r.uploaded(&ids(4, 11));
        // Then 2, the oldest now.
        let p = r.plan(&ids(4, 12), |_| false).unwrap();
        assert_eq!((p.slot, p.wait), (2, true));
    }

    #[test]
    fn the_same_list_again_is_not_copied() {
        let mut r = IdRing::new(2);
        let a = ids(30, 1);
        assert!(r.plan(&a, |_| true).is_some());
        r.uploaded(&a);
        assert!(r.holds(&a) && !r.holds(&a[1..]));
        assert_eq!(r.plan(&a, |_| panic!("no slot is asked for")), None);
        let b = ids(30, 2);
        assert!(r.plan(&b, |_| true).is_some());
        r.uploaded(&b);
        assert!(r.plan(&a, |_| true).is_some(), "a list held before another is copied again");
        // A plan whose copy never happened (a failed upload) leaves nothing held.
        assert!(r.plan(&a, |_| true).is_some());
        assert!(!r.holds(&a) && !r.holds(&b));
        assert!(r.plan(&a, |_| true).is_some());
    }

    #[test]
    fn buffers_grow_to_powers_of_two_only_for_a_longer_list() {
        let mut r = IdRing::new(2);
        let p = r.plan(&ids(5, 0), |_| true).unwrap();
        assert_eq!((p.grow_slot, p.grow_device), (Some(MIN_WORDS), Some(MIN_WORDS)), "made on first use");
        r.uploaded(&ids(5, 0));
        let p = r.plan(&ids(MIN_WORDS, 1), |_| true).unwrap();
        assert_eq!((p.slot, p.grow_slot, p.grow_device), (1, Some(MIN_WORDS), None), "the second slot's first use");
        r.uploaded(&ids(MIN_WORDS, 1));
        let p = r.plan(&ids(MIN_WORDS + 1, 2), |_| true).unwrap();
        assert_eq!((p.slot, p.grow_slot, p.grow_device), (0, Some(2 * MIN_WORDS), Some(2 * MIN_WORDS)));
        r.uploaded(&ids(MIN_WORDS + 1, 2));
        let p = r.plan(&ids(3, 3), |_| true).unwrap();
        assert_eq!((p.slot, p.grow_slot, p.grow_device), (1, None, None), "never shrunk");
        r.uploaded(&ids(3, 3));
        let p = r.plan(&ids(5000, 4), |_| true).unwrap();
        assert_eq!((p.slot, p.grow_slot, p.grow_device), (0, Some(8192), Some(8192)));
        assert_eq!(capacity_for(0), MIN_WORDS);
    }

    #[test]
    fn a_failed_upload_makes_its_slot_and_the_device_buffer_again() {
        let mut r = IdRing::new(2);
        for i in 0..2 {
            r.plan(&ids(5, i), |_| true).unwrap();
            r.uploaded(&ids(5, i));
        }
        let p = r.plan(&ids(5, 9), |_| true).unwrap();
        assert_eq!((p.slot, p.grow_slot, p.grow_device), (0, None, None));
        r.failed(p.slot);
        assert!(!r.holds(&ids(5, 1)), "the device buffer holds nothing known");
        let p = r.plan(&ids(5, 9), |_| true).unwrap();
        assert_eq!((p.slot, p.grow_slot, p.grow_device), (1, None, Some(MIN_WORDS)), "the untouched slot is kept");
        r.uploaded(&ids(5, 9));
        let p = r.plan(&ids(5, 10), |_| true).unwrap();
        assert_eq!((p.slot, p.grow_slot, p.grow_device), (0, Some(MIN_WORDS), None));
    }
}
