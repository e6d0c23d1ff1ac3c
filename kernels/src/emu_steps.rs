//! The CUDA backend's replayable decode steps (`cuda/graph.rs`) as the
//! emulated backend runs them, so that the engine's side of them (padding a
//! step to its bucket, returning only the real rows' logits) and the rules a
//! captured step must keep run in CI without a GPU:
//!
//! - a step's inputs are staged into one array of words ([`StepLayout`]) and,
//!   in step mode, the emulated kernels read tokens, positions, KV slots,
//!   logit rows and attention's tables from there, not from the host's slices;
//! - the same states as the GPU's graphs: a shape's first step runs eagerly,
//!   the next is "captured", later ones "replayed", and any allocation moves
//!   the generation and sends the shape back to eager;
//! - while a step is "captured" or "replayed" the [`CaptureGuard`] is armed:
//!   an allocation, or an upload the CUDA backend would make from host memory,
//!   is recorded as refused (the CPU runs it anyway: nothing is deferred here),
//!   which on a GPU would have thrown the capture away.
//!
//! What the GPU alone shows (the driver's capture rules, a graph's speed) is
//! bench/gpu/run.sh's.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::attention::AttnRow;
use crate::cuda::step_inputs::{StepLayout, StepShape};
use crate::kv::KvStorage;
use crate::step::{CaptureGuard, StepInput};

/// Counts of the emulated graph states, and what was refused while armed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EmuStepStats {
    pub eager: u64,
    pub captures: u64,
    pub replays: u64,
    /// Steps that did not fit their shape's words and ran as they were.
    pub unfit: u64,
    /// Steps whose tokens were the last step's picks, taken on the device (run-ahead).
    pub fed: u64,
    pub refused: Vec<&'static str>,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    program: usize,
    arena: usize,
    shape: StepShape,
}

#[derive(Default)]
struct Entry {
    warm_at: Option<u64>,
    captured_at: Option<u64>,
}

/// The step under way: its layout and staged words.
pub(crate) struct Staged {
    pub layout: StepLayout,
    pub words: Vec<u32>,
}

impl Staged {
    pub fn words(&self, r: &std::ops::Range<usize>) -> &[u32] {
        &self.words[r.clone()]
    }

    /// `(block, slot)` pairs of the staged slots.
    pub fn slots(&self) -> Vec<(u32, u32)> {
        self.words(&self.layout.slots).chunks_exact(2).map(|p| (p[0], p[1])).collect()
    }

    /// Attention rows read back from the staged tables, offsets and positions.
    pub fn attn_rows(&self) -> Vec<AttnRow<'_>> {
        let l = &self.layout;
        let (tables, offsets, positions) = (self.words(&l.tables), self.words(&l.offsets), self.words(&l.positions));
        (0..l.shape.rows).map(|r| AttnRow { block_table: &tables[offsets[r] as usize..][..l.table_cap], pos: positions[r] as usize }).collect()
    }
}

/// Step mode of an `EmuBackend` made with `with_decode_steps`.
#[derive(Default)]
pub(crate) struct EmuSteps {
    entries: HashMap<Key, Entry>,
    pub active: Option<Staged>,
    pub stats: EmuStepStats,
}

enum Run {
    Eager,
    Capture,
    Replay,
}

/// `Backend::decode_step` of the emulated backend; `kv` has one spare block past
/// the engine's (the padding rows'). With `fed` (`Backend::decode_step_fed`: the
/// step's first tokens as the device holds them), the staged tokens are those;
/// a fed step that does not fit runs nothing and returns false.
pub(crate) fn decode_step(steps: &Mutex<EmuSteps>, guard: &CaptureGuard, kv: &mut KvStorage, input: &StepInput, program: usize, fed: Option<&[u32]>, body: &mut dyn FnMut(&mut KvStorage)) -> bool {
    let lock = || steps.lock().unwrap_or_else(|p| p.into_inner());
    let shape = StepShape::of(input);
    let layout = StepLayout::new(shape, kv.layout.block_tokens);
    let mut words = vec![0u32; layout.words];
    let engine_blocks = kv.num_blocks - 1;
    if layout.fill(input, engine_blocks, engine_blocks as u32, &mut words).is_err() {
        if fed.is_some() {
            return false;
        }
        lock().stats.unfit += 1;
        body(kv);
        return true;
    }
    if let Some(fed) = fed {
        words[layout.tokens.start..][..fed.len()].copy_from_slice(fed);
        lock().stats.fed += 1;
    }
    let key = Key { program, arena: kv as *const KvStorage as usize, shape };
    let generation = guard.generation();
    let run = {
        let mut st = lock();
        st.active = Some(Staged { layout, words });
        let e = st.entries.entry(key).or_default();
        match (e.captured_at, e.warm_at) {
            (Some(at), _) if at == generation => Run::Replay,
            (_, Some(at)) if at == generation => Run::Capture,
            _ => Run::Eager,
        }
    };
    if let Run::Eager = run {
        body(kv);
        let mut st = lock();
        st.stats.eager += 1;
        let e = st.entries.get_mut(&key).expect("inserted above");
        (e.warm_at, e.captured_at) = (Some(guard.generation()), None);
    } else {
        guard.arm();
        body(kv);
        let refused = guard.disarm();
        let mut st = lock();
        let e = st.entries.get_mut(&key).expect("inserted above");
        if !refused.is_empty() {
            // The GPU would have thrown this capture away and run the step eagerly.
            (e.warm_at, e.captured_at) = (Some(guard.generation()), None);
            st.stats.refused.extend(refused);
        } else if let Run::Capture = run {
            e.captured_at = Some(generation);
            st.stats.captures += 1;
        } else {
            st.stats.replays += 1;
        }
    }
    lock().active = None;
    true
}
