//! Index lists (a KV pack's or unpack's block ids, an eager step's tokens and logit rows)
//! moved to the device through page-locked memory into one reusable device buffer.
//!
//! `memcpy_stod` from a `Vec` costs, per call, a device allocation, its free (without
//! stream-ordered allocation a free first synchronizes the whole stream) and a copy from
//! pageable memory, which the driver may finish before returning, after the stream's queued
//! work. A pipelined export paid that once per layer, an import once per received frame.
//! Here instead:
//!
//! - A ring of [`SLOTS`] page-locked host buffers ([`HostBuf`], whose pointer is taken once,
//!   at allocation), made on first use, each with an event recorded after the copy that
//!   reads it. A slot is refilled only once that event completed: the least recently used
//!   completed slot is taken, else the least recently used one after waiting on its event
//!   (that one copy, never the whole stream).
//! - One device buffer, grown (never shrunk) when a longer list comes, and the words it
//!   holds: a list equal to the last one is not copied again (a forward pass exports the
//!   same blocks at every layer; an import's frames repeat a run's blocks layer by layer).
//!
//! Why one device buffer is enough: every copy into it and every kernel that reads it are
//! queued on the backend's one compute stream, and [`Uploaded`] keeps the lock from the
//! copy until the caller's launch is queued, so no other thread's copy lands in between.
//! A stream runs its work in order: the next copy into the buffer starts only after every
//! kernel queued before it, the readers of the previous list included, has finished. A grown
//! buffer's old allocation is freed in stream order too (`cuMemFreeAsync`, or `cuMemFree`
//! after a stream synchronize where the driver lacks it).
//!
//! Nothing is uploaded during a CUDA graph capture (callers ask the `CaptureGuard` first,
//! as for any pageable upload): a captured copy would read its slot again at every replay,
//! long after the slot was refilled, and the device buffer may not grow inside a capture.

use std::sync::{Arc, MutexGuard};

use cudarc::driver::{result, CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, DevicePtrMut, DriverError};

use super::staging::HostBuf;

/// Host slots: uploads the host may queue ahead of the GPU before it waits on the oldest.
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

    /// The upload of `words`, or `None` when the device buffer already holds them.
    /// `done(slot)` says whether the slot's last copy has completed (true for a slot
    /// never used). Until [`IdRing::uploaded`] the device buffer counts as holding nothing.
    pub fn plan(&mut self, words: &[u32], done: impl Fn(usize) -> bool) -> Option<Plan> {
        if self.held.as_deref() == Some(words) {
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

    /// The copy of `words` into the device buffer is queued.
    pub fn uploaded(&mut self, words: &[u32]) {
        let held = self.held.get_or_insert_with(Vec::new);
        held.clear();
        held.extend_from_slice(words);
    }
}

/// The ring's host slots and events, and the device buffer.
pub(super) struct IdUploads {
    ring: IdRing,
    host: Vec<Option<HostBuf>>,
    /// `copied[i]`: recorded after the last copy out of `host[i]`.
    copied: Vec<CudaEvent>,
    device: Option<CudaSlice<u32>>,
    /// Why a slot is ordinary memory (page-locking failed), if one is.
    pub pageable_because: Option<String>,
}

impl IdUploads {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<IdUploads, DriverError> {
        let copied = (0..SLOTS).map(|_| ctx.new_event(None)).collect::<Result<_, _>>()?;
        Ok(IdUploads { ring: IdRing::new(SLOTS), host: (0..SLOTS).map(|_| None).collect(), copied, device: None, pageable_because: None })
    }

    /// Queues the copy of `words` into the device buffer on `stream` (nothing when it holds
    /// them already); the caller checked the capture guard.
    fn upload(&mut self, ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, words: &[u32]) -> Result<(), DriverError> {
        let copied = &self.copied;
        let Some(plan) = self.ring.plan(words, |s| copied[s].is_complete()) else { return Ok(()) };
        if plan.wait {
            self.copied[plan.slot].synchronize()?;
        }
        if let Some(n) = plan.grow_slot {
            // The old buffer's copy is done (waited above, or its event had completed).
            self.host[plan.slot] = None;
            let host = HostBuf::new(ctx, n * 4, true).or_else(|e| {
                self.pageable_because.get_or_insert_with(|| format!("cuMemHostAlloc of {} KiB: {e:?}", n >> 8));
                HostBuf::new(ctx, n * 4, false)
            })?;
            self.host[plan.slot] = Some(host);
        }
        if let Some(n) = plan.grow_device {
            // Freed in stream order, after the kernels queued on it. Not an allocation the
            // capture guard counts: no captured graph reads this buffer (nothing is uploaded
            // during a capture, so no captured kernel gets a view of it).
            self.device = None;
            self.device = Some(stream.alloc_zeros::<u32>(n)?);
        }
        let host = self.host[plan.slot].as_mut().expect("a slot is made before its first copy");
        let bytes = std::mem::size_of_val(words);
        // SAFETY: a u32 slice viewed as its bytes (any bit pattern is a valid u8).
        let src = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), bytes) };
        host.as_mut_slice()[..bytes].copy_from_slice(src);
        let device = self.device.as_mut().expect("the device buffer is made before its first copy");
        let (dst, _guard) = device.device_ptr_mut(stream);
        // SAFETY: both buffers hold `words` (grown above); the slot is not written again
        // before its event completes, and the device buffer's readers are ordered by the stream.
        unsafe { result::memcpy_htod_async(dst, &host.as_slice()[..bytes], stream.cu_stream()) }?;
        self.copied[plan.slot].record(stream)?;
        self.ring.uploaded(words);
        Ok(())
    }
}

impl Drop for IdUploads {
    fn drop(&mut self) {
        // No copy may still read a slot about to be freed.
        for e in &self.copied {
            let _ = e.synchronize();
        }
    }
}

/// A list on the device, valid for kernels queued while this lives (it holds the lock
/// that keeps the next list out of the buffer until they are queued).
pub(super) struct Uploaded<'a> {
    ids: MutexGuard<'a, IdUploads>,
    len: usize,
}

impl<'a> Uploaded<'a> {
    /// Queues `words` on `stream` through `ids`' ring.
    pub fn new(mut ids: MutexGuard<'a, IdUploads>, ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, words: &[u32]) -> Result<Uploaded<'a>, DriverError> {
        if let Err(e) = ids.upload(ctx, stream, words) {
            // What the device buffer holds is unknown after a failed copy.
            ids.ring.held = None;
            return Err(e);
        }
        Ok(Uploaded { ids, len: words.len() })
    }

    pub fn view(&self) -> CudaView<'_, u32> {
        let device = self.ids.device.as_ref().expect("uploaded");
        device.slice(..self.len)
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
        assert_eq!(r.plan(&a, |_| panic!("no slot is asked for")), None);
        let b = ids(30, 2);
        assert!(r.plan(&b, |_| true).is_some());
        r.uploaded(&b);
        assert!(r.plan(&a, |_| true).is_some(), "a list held before another is copied again");
        // A plan whose copy never happened (a failed upload) leaves nothing held.
        assert!(r.plan(&a, |_| true).is_some());
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
}
