//! The planning rules driven through a simulated block pool: no model, no
//! backend. The simulation does what the worker does with the real cache,
//! minus the prefix cache: admission reserves blocks for the whole sequence
//! plus one token; preemption gives every block back and recomputes, or (in
//! swap mode) keeps a copy of them outside the pool and takes as many back.

use super::*;
use proptest::prelude::*;
use std::collections::VecDeque;

#[derive(Clone, Debug)]
struct SimSeq {
    id: SeqId,
    max_new: usize,
    tokens: usize,
    computed: usize,
    blocks: usize,
    generated: usize,
    preemptions: usize,
    /// Blocks copied out of the pool at preemption (swap mode).
    swapped: Option<usize>,
}

/// Queues over a pool that only counts blocks, and checks every return.
struct Sim {
    swap: bool,
    block_tokens: usize,
    total_blocks: usize,
    free: usize,
    running: Vec<SimSeq>,
    waiting: VecDeque<SimSeq>,
    finished: Vec<SimSeq>,
    rejected: Vec<SeqId>,
    admitted: Vec<SeqId>,
}

impl Sim {
    fn new(total_blocks: usize, block_tokens: usize) -> Self {
        Sim {
            swap: false,
            block_tokens,
            total_blocks,
            free: total_blocks,
            running: Vec::new(),
            waiting: VecDeque::new(),
            finished: Vec::new(),
            rejected: Vec::new(),
            admitted: Vec::new(),
        }
    }

    fn submit(&mut self, id: u64, prompt: usize, max_new: usize) {
        assert!(prompt > 0 && max_new > 0);
        let seq = SimSeq { id: SeqId(id), max_new, tokens: prompt, computed: 0, blocks: 0, generated: 0, preemptions: 0, swapped: None };
        self.waiting.push_back(seq);
    }

    fn take(&mut self, n: usize) -> bool {
        if self.free < n {
            return false;
        }
        self.free -= n;
        true
    }

    fn give_back(&mut self, n: usize) {
        assert!(self.free + n <= self.total_blocks, "double free: {} free + {n} returned > {} blocks", self.free, self.total_blocks);
        self.free += n;
    }

    /// Every block is either free or held by exactly one sequence.
    fn check_accounting(&self) {
        let held: usize = self.running.iter().chain(&self.waiting).map(|s| s.blocks).sum();
        assert_eq!(self.free + held, self.total_blocks, "blocks leaked: {} free + {held} held", self.free);
    }

    fn is_done(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    fn running_ids(&self) -> Vec<SeqId> {
        self.running.iter().map(|s| s.id).collect()
    }

    fn waiting_ids(&self) -> Vec<SeqId> {
        self.waiting.iter().map(|s| s.id).collect()
    }

    /// Plans one step, checks it against the rules every step must keep,
    /// and runs it: each slice computes its tokens, a slice that reaches the
    /// end samples one more, and a sequence with all its tokens finishes.
    fn step(&mut self, limits: Limits) -> StepPlan {
        let decoders_before: Vec<SeqId> = self.running.iter().filter(|s| s.tokens - s.computed == 1).map(|s| s.id).collect();
        let plan = plan_step(self, limits);
        assert!(plan.tokens() <= limits.step_token_budget, "step of {} tokens over the budget of {}", plan.tokens(), limits.step_token_budget);
        // Rule 2: beside decode rows, prefill stays within its allowance.
        let rows = plan.slices.iter().filter(|sl| sl.len == 1 && decoders_before.contains(&self.running[sl.seq].id)).count();
        let prefill = plan.tokens() - rows;
        if rows > 0 {
            assert!(prefill <= prefill_allowance(limits), "{prefill} prefill tokens beside {rows} decode rows over the allowance of {}", prefill_allowance(limits));
        }
        // Decode first: every stream that was ready decodes unless the step
        // budget ran out or it was preempted.
        if rows < limits.step_token_budget {
            for id in decoders_before {
                let ran = plan.slices.iter().any(|sl| self.running.get(sl.seq).map(|s| s.id) == Some(id));
                assert!(ran || plan.preempted.contains(&id), "stream {id:?} was ready but got no row in {plan:?}");
            }
        }
        assert!(self.running.len() <= limits.max_running, "{} running over the cap of {}", self.running.len(), limits.max_running);
        for (k, sl) in plan.slices.iter().enumerate() {
            assert!(sl.len > 0, "empty slice {sl:?}");
            assert!(plan.slices[..k].iter().all(|other| other.seq != sl.seq), "sequence {} twice in one step", sl.seq);
            let s = &mut self.running[sl.seq];
            assert_eq!(sl.start, s.computed, "slice {sl:?} does not continue where {:?} stands", s.id);
            assert!(sl.start + sl.len <= s.tokens, "slice {sl:?} past the tokens of {:?}", s.id);
            assert!((sl.start + sl.len).div_ceil(self.block_tokens) <= s.blocks, "slice {sl:?} outside the blocks {:?} holds", s.id);
            assert_eq!(sl.wants_logits, sl.start + sl.len == s.tokens);
            s.computed += sl.len;
            if sl.wants_logits {
                s.tokens += 1;
                s.generated += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].generated == self.running[i].max_new {
                let seq = self.running.remove(i);
                self.give_back(seq.blocks);
                self.finished.push(seq);
            } else {
                i += 1;
            }
        }
        if plan.reject_head {
            assert!(plan.slices.is_empty() && self.running.is_empty());
            let seq = self.waiting.pop_front().expect("reject_head with an empty queue");
            self.give_back(seq.blocks);
            self.rejected.push(seq.id);
        }
        self.admitted.extend(&plan.admitted);
        self.check_accounting();
        plan
    }

    /// Steps until nothing is left; panics past `max_steps` (a livelock).
    fn run_to_end(&mut self, limits: Limits, max_steps: usize) -> usize {
        let mut steps = 0;
        while !self.is_done() {
            assert!(steps < max_steps, "not done after {max_steps} steps: running {:?}, waiting {:?}", self.running, self.waiting);
            self.step(limits);
            steps += 1;
        }
        steps
    }
}

impl Queues for Sim {
    fn running_len(&self) -> usize {
        self.running.len()
    }
    fn progress(&self, running: usize) -> SeqProgress {
        let s = &self.running[running];
        SeqProgress { id: s.id, tokens: s.tokens, computed: s.computed, blocks: s.blocks }
    }
    fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }
    fn grow(&mut self, running: usize, upto: usize) -> bool {
        let need = upto.div_ceil(self.block_tokens).saturating_sub(self.running[running].blocks);
        if !self.take(need) {
            return false;
        }
        self.running[running].blocks += need;
        true
    }
    fn preempt(&mut self, running: usize) {
        let mut seq = self.running.remove(running);
        self.give_back(seq.blocks);
        if self.swap && seq.blocks > 0 {
            // As the worker: the copy keeps `computed`.
            seq.swapped = Some(seq.blocks);
        } else {
            seq.computed = 0;
        }
        seq.blocks = 0;
        seq.preemptions += 1;
        self.waiting.push_front(seq);
    }
    fn admit_head(&mut self) -> Admission {
        let Some(mut seq) = self.waiting.pop_front() else { return Admission::NoRoom };
        if let Some(n) = seq.swapped {
            if !self.take(n) {
                self.waiting.push_front(seq);
                return Admission::NoRoom;
            }
            seq.swapped = None;
            seq.blocks = n;
            seq.computed = seq.computed.min(n * self.block_tokens);
            self.running.push(seq);
            return Admission::Running;
        }
        // As the worker's `start_fresh`: the whole sequence plus one token.
        let need = (seq.tokens + 1).div_ceil(self.block_tokens);
        if !self.take(need) {
            self.waiting.push_front(seq);
            return Admission::NoRoom;
        }
        seq.blocks = need;
        seq.computed = 0;
        self.running.push(seq);
        Admission::Running
    }
    fn requeue_last(&mut self) {
        let last = self.running.len().checked_sub(1).expect("requeue with nothing running");
        self.preempt(last);
    }
}

fn limits(step_token_budget: usize, max_running: usize, block_tokens: usize) -> Limits {
    Limits { step_token_budget, prefill_token_budget: usize::MAX, max_running, block_tokens }
}


fn ids(raw: &[u64]) -> Vec<SeqId> {
    raw.iter().map(|&i| SeqId(i)).collect()
}

fn slice_lens(plan: &StepPlan) -> Vec<usize> {
    plan.slices.iter().map(|s| s.len).collect()
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_of_the_budget() {
    let lim = limits(16, 8, 4);
    let mut sim = Sim::new(64, 4);
    sim.submit(1, 50, 2);
    assert_eq!(sim.step(lim).slices, vec![Slice { seq: 0, start: 0, len: 16, wants_logits: false }]);
    assert_eq!(slice_lens(&sim.step(lim)), vec![16]);
    assert_eq!(slice_lens(&sim.step(lim)), vec![16]);
    assert_eq!(sim.step(lim).slices, vec![Slice { seq: 0, start: 48, len: 2, wants_logits: true }]);
    assert_eq!(sim.step(lim).slices, vec![Slice { seq: 0, start: 50, len: 1, wants_logits: true }]);
    assert!(sim.is_done());
    assert_eq!(sim.free, 64);
}

#[test]
fn decode_rows_stop_at_the_budget() {
    // Admission keeps decoders within the budget, so this state is built by
    // hand: five sequences that each decode, a budget of three.
    let lim = limits(3, 8, 4);
    let mut sim = Sim::new(8, 4);
    for id in 1..=5 {
        sim.running.push(SimSeq { id: SeqId(id), max_new: 5, tokens: 4, computed: 3, blocks: 1, generated: 1, preemptions: 0, swapped: None });
        sim.free -= 1;
    }
    let plan = sim.step(lim);
    assert_eq!(plan.slices.iter().map(|s| (s.seq, s.len)).collect::<Vec<_>>(), vec![(0, 1), (1, 1), (2, 1)]);
    // Rows go in admission order; the last two wait.
    assert_eq!(sim.running.iter().map(|s| s.generated).collect::<Vec<_>>(), vec![2, 2, 2, 1, 1]);
}

#[test]
fn prefill_chunks_share_the_budget_in_admission_order_after_decode_rows() {
    let lim = limits(16, 8, 4);
    let mut sim = Sim::new(64, 4);
    sim.submit(1, 10, 5);
    sim.submit(2, 10, 5);
    let first = sim.step(lim);
    assert_eq!(first.admitted, ids(&[1, 2]));
    assert_eq!(slice_lens(&first), vec![10, 6]);
    // Sequence 1 now decodes: its row comes first, then the rest of 2's prompt.
    let second = sim.step(lim);
    assert_eq!(second.slices, vec![Slice { seq: 0, start: 10, len: 1, wants_logits: true }, Slice { seq: 1, start: 6, len: 4, wants_logits: true }]);
}

#[test]
fn decode_rows_are_not_starved_by_a_long_prefill() {
    let lim = limits(8, 8, 4);
    let mut sim = Sim::new(400, 4);
    sim.submit(1, 3, 30);
    sim.step(lim);
    sim.submit(2, 1000, 1);
    for _ in 0..29 {
        let plan = sim.step(lim);
        // Sequence 1 was admitted first: it is running sequence 0.
        assert_eq!(plan.slices.first().map(|sl| (sl.seq, sl.len)), Some((0, 1)), "sequence 1 got no decode row in {plan:?}");
        assert_eq!(plan.tokens(), 8, "the prefill should take the rest of the budget: {plan:?}");
    }
    assert_eq!(sim.finished.iter().map(|s| s.id).collect::<Vec<_>>(), ids(&[1]));
}

#[test]
fn admission_is_first_come_first_served() {
    // 12 blocks of 4 tokens. 1 takes 3 blocks; 2 needs 11, so it waits; 3
    // (2 blocks) would fit beside 1 but must not jump ahead of 2.
    let lim = limits(64, 8, 4);
    let mut sim = Sim::new(12, 4);
    sim.submit(1, 8, 2);
    sim.submit(2, 40, 1);
    sim.submit(3, 4, 1);
    let first = sim.step(lim);
    assert_eq!(first.admitted, ids(&[1]));
    assert_eq!(sim.waiting_ids(), ids(&[2, 3]));
    sim.run_to_end(lim, 50);
    assert_eq!(sim.admitted, ids(&[1, 2, 3]));
    assert!(sim.rejected.is_empty());
}

#[test]
fn max_running_caps_admission() {
    let lim = limits(64, 2, 4);
    let mut sim = Sim::new(64, 4);
    for id in 1..=4 {
        sim.submit(id, 4, 3);
    }
    assert_eq!(sim.step(lim).admitted, ids(&[1, 2]));
    assert_eq!(sim.waiting_ids(), ids(&[3, 4]));
    sim.run_to_end(lim, 50);
    assert_eq!(sim.admitted, ids(&[1, 2, 3, 4]));
}

#[test]
fn when_blocks_run_out_the_most_recently_admitted_are_preempted_first() {
    // Three sequences of one block each fill the pool of 3; each needs a
    // second block at its fifth token.
    let lim = limits(16, 8, 4);
    let mut sim = Sim::new(3, 4);
    for id in 1..=3 {
        sim.submit(id, 3, 4);
    }
    assert_eq!(sim.step(lim).admitted, ids(&[1, 2, 3]));
    assert!(sim.step(lim).preempted.is_empty());
    // 1 needs a block: 3 (the newest) goes; 2 then needs one and, with 1
    // already in the step, only 2 itself is left to go.
    let third = sim.step(lim);
    assert_eq!(third.preempted, ids(&[3, 2]));
    assert_eq!(sim.running_ids(), ids(&[1]));
    assert_eq!(third.slices, vec![Slice { seq: 0, start: 4, len: 1, wants_logits: true }]);
    // The preempted wait ahead of a newer arrival, oldest first.
    assert_eq!(sim.waiting_ids(), ids(&[2, 3]));
    sim.submit(4, 3, 1);
    sim.run_to_end(lim, 100);
    assert_eq!(sim.admitted, ids(&[1, 2, 3, 2, 3, 4]));
    // Preempted sequences resumed and generated all their tokens.
    for s in &sim.finished {
        assert_eq!(s.generated, s.max_new, "{:?}", s.id);
    }
    assert_eq!(sim.finished.iter().filter(|s| s.preemptions > 0).count(), 2);
    assert_eq!(sim.free, 3);
}

#[test]
fn a_swapped_in_sequence_without_room_for_its_next_block_is_parked_again() {
    // As the preemption test, swapping: 2 and 3 go out with one block each.
    // 2 comes back into the one free block, but its next token needs a second.
    let lim = limits(16, 8, 4);
    let mut sim = Sim::new(3, 4);
    sim.swap = true;
    for id in 1..=3 {
        sim.submit(id, 3, 4);
    }
    sim.step(lim);
    sim.step(lim);
    let third = sim.step(lim);
    assert_eq!(third.preempted, ids(&[3, 2]));
    assert!(third.admitted.is_empty(), "2 got its blocks back but not the next one: {third:?}");
    assert_eq!(sim.waiting_ids(), ids(&[2, 3]));
    assert_eq!(sim.waiting[0].swapped, Some(1), "2 is parked again, its block with it");
    assert_eq!(sim.waiting[0].preemptions, 2);
    assert_eq!(sim.free, 1);
    sim.run_to_end(lim, 100);
    assert_eq!(sim.finished.len(), 3);
    assert_eq!(sim.free, 3);
}

#[test]
fn a_sequence_that_cannot_fit_even_alone_is_rejected_not_retried() {
    let lim = limits(64, 8, 4);
    let mut sim = Sim::new(4, 4);
    sim.submit(1, 20, 1);
    sim.submit(2, 4, 1);
    let plan = sim.step(lim);
    assert!(plan.reject_head && plan.slices.is_empty());
    assert_eq!(sim.rejected, ids(&[1]));
    // The one behind it runs as usual.
    sim.run_to_end(lim, 10);
    assert_eq!(sim.finished.iter().map(|s| s.id).collect::<Vec<_>>(), ids(&[2]));
    assert_eq!(sim.free, 4);
}

#[test]
fn a_sequence_that_outgrows_the_whole_pool_is_rejected_in_the_step_it_does() {
    // 4 blocks hold 16 tokens; the 17th cannot be had even with nothing else running.
    let lim = limits(64, 8, 4);
    let mut sim = Sim::new(4, 4);
    sim.submit(1, 10, 20);
    let steps = sim.run_to_end(lim, 30);
    assert_eq!(sim.rejected, ids(&[1]));
    assert_eq!(steps, 8, "prefill, six decodes filling 16 tokens, then the rejection");
    assert_eq!(sim.free, 4);
}

#[test]
fn a_partly_grown_step_is_replanned_from_a_fresh_budget() {
    // 1 and 2 decode; 2's growth preempts 3 (prefilling, newest). The
    // replan must not count 1's row twice against the budget.
    let lim = limits(3, 8, 2);
    let mut sim = Sim::new(6, 2);
    sim.submit(1, 1, 10);
    sim.submit(2, 1, 10);
    sim.step(lim);
    sim.submit(3, 5, 1);
    let mut preempted = Vec::new();
    for _ in 0..20 {
        let plan = sim.step(lim);
        assert!(plan.tokens() <= 3);
        preempted.extend(plan.preempted);
    }
    assert!(preempted.contains(&SeqId(3)), "the workload should force a preemption: {preempted:?}");
    sim.run_to_end(lim, 100);
    assert_eq!(sim.finished.len(), 3);
}

fn itl_limits(step_token_budget: usize, prefill_token_budget: usize, block_tokens: usize) -> Limits {
    Limits { step_token_budget, prefill_token_budget, max_running: 8, block_tokens }
}

#[test]
fn beside_decode_rows_a_long_prompt_goes_in_chunks_of_the_prefill_budget() {
    let lim = itl_limits(64, 10, 4);
    let mut sim = Sim::new(100, 4);
    sim.submit(1, 3, 6);
    sim.step(lim);
    sim.submit(2, 100, 1);
    for k in 0..5 {
        let plan = sim.step(lim);
        assert_eq!(plan.slices[0], Slice { seq: 0, start: 3 + k, len: 1, wants_logits: true });
        assert_eq!(slice_lens(&plan), vec![1, 10], "step {k}: {plan:?}");
    }
    // 1 finished: the rest of the prompt goes at the full step budget.
    assert_eq!(sim.finished.iter().map(|s| s.id).collect::<Vec<_>>(), ids(&[1]));
    assert_eq!(slice_lens(&sim.step(lim)), vec![50]);
}

#[test]
fn without_decode_rows_prefill_takes_the_whole_step_budget() {
    let lim = itl_limits(64, 10, 4);
    let mut sim = Sim::new(100, 4);
    sim.submit(1, 100, 1);
    assert_eq!(slice_lens(&sim.step(lim)), vec![64]);
    assert_eq!(slice_lens(&sim.step(lim)), vec![36]);
}

#[test]
fn with_no_room_under_the_target_prefill_still_gets_one_block_per_step() {
    // The decode rows alone are over the target (budget 0): the floor keeps the
    // prompt moving a block at a time, and it finishes.
    let lim = itl_limits(64, 0, 4);
    let mut sim = Sim::new(100, 4);
    sim.submit(1, 2, 40);
    sim.submit(2, 2, 40);
    sim.step(lim);
    sim.submit(3, 30, 2);
    let plan = sim.step(lim);
    assert_eq!(plan.admitted, ids(&[3]));
    assert_eq!(slice_lens(&plan), vec![1, 1, 4]);
    let mut steps = 1;
    loop {
        let left = 30 - sim.running[2].computed;
        if left == 0 {
            break;
        }
        assert_eq!(slice_lens(&sim.step(lim)), vec![1, 1, left.min(4)]);
        steps += 1;
    }
    // 30 tokens, four a step.
    assert_eq!(steps, 8);
}

#[test]
fn a_new_turn_waits_for_prefill_budget_rather_than_stretch_the_streams() {
    // 2 is mid-prefill and takes the step's whole prefill budget; 3 arrives
    // and is not admitted (no chunk of it would fit) until 2's prompt is in.
    let lim = itl_limits(64, 8, 4);
    let mut sim = Sim::new(100, 4);
    sim.submit(1, 2, 30);
    sim.step(lim);
    sim.submit(2, 24, 2);
    sim.step(lim);
    sim.submit(3, 8, 2);
    let plan = sim.step(lim);
    assert!(plan.admitted.is_empty(), "{plan:?}");
    assert_eq!(slice_lens(&plan), vec![1, 8]);
    let plan = sim.step(lim);
    assert_eq!(slice_lens(&plan), vec![1, 8]);
    assert!(plan.admitted.is_empty(), "{plan:?}");
    // 2's prompt is in; 2 decodes, and 3 gets the prefill budget.
    let plan = sim.step(lim);
    assert_eq!(plan.admitted, ids(&[3]));
    assert_eq!(slice_lens(&plan), vec![1, 1, 8]);
}

/// Block tokens, spare blocks, step budget, max running, and per sequence
/// (prompt, reply, arrival step).
type Workload = (usize, usize, usize, usize, Vec<(usize, usize, usize)>);

fn workload() -> impl Strategy<Value = Workload> {
    (1usize..=8, 0usize..=12, 1usize..=64, 1usize..=8, prop::collection::vec((1usize..=60, 1usize..=20, 0usize..=20), 1..=12))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any workload whose every sequence fits the pool alone, preempted by
    /// recompute or by swap, under any prefill budget: budgets and
    /// caps hold every step, no block leaks or is freed twice, nothing is
    /// rejected, and every sequence (preempted or not) finishes with all its
    /// tokens within a bound of steps.
    #[test]
    fn every_sequence_finishes_and_every_block_comes_back(
        (bt, spare, budget, max_running, seqs) in workload(),
        swap in any::<bool>(),
        prefill_budget in prop_oneof![Just(usize::MAX), 0usize..=16],
    ) {
        // The largest sequence, at its last sampled token, must fit alone.
        let largest = seqs.iter().map(|&(p, n, _)| (p + n).div_ceil(bt)).max().unwrap_or(1);
        let total_blocks = largest + spare;
        // Any prefill budget, 0 included (decode rows alone over the target):
        // the floor keeps every prompt moving.
        let lim = Limits { prefill_token_budget: prefill_budget, ..limits(budget, max_running, bt) };
        let mut sim = Sim::new(total_blocks, bt);
        sim.swap = swap;
        let last_arrival = seqs.iter().map(|s| s.2).max().unwrap_or(0);
        let work: usize = seqs.iter().map(|&(p, n, _)| p + n).sum();
        // Loose on purpose (recompute after preemption repeats work); a
        // livelock or a starved sequence never finishes at all.
        let bound = last_arrival + 1 + (seqs.len() + 1) * work;
        let mut step = 0;
        loop {
            for (id, &(prompt, max_new, arrival)) in seqs.iter().enumerate() {
                if arrival == step {
                    sim.submit(id as u64, prompt, max_new);
                }
            }
            if step > last_arrival && sim.is_done() {
                break;
            }
            prop_assert!(step <= bound, "step {step} over the bound {bound}: running {:?}, waiting {:?}", sim.running, sim.waiting);
            sim.step(lim);
            step += 1;
        }
        prop_assert!(sim.rejected.is_empty(), "rejected {:?}", sim.rejected);
        prop_assert_eq!(sim.free, total_blocks);
        prop_assert_eq!(sim.finished.len(), seqs.len());
        for s in &sim.finished {
            let (prompt, max_new, _) = seqs[s.id.0 as usize];
            prop_assert_eq!(s.generated, max_new);
            prop_assert_eq!(s.tokens, prompt + max_new);
        }
    }

    /// Pools too small for some sequences: those are rejected (each once),
    /// the rest finish, and the pool still comes back whole.
    #[test]
    fn sequences_too_big_for_the_pool_are_rejected_and_the_rest_finish((bt, _spare, budget, max_running, seqs) in workload(), total_blocks in 1usize..=12, swap in any::<bool>()) {
        let lim = limits(budget, max_running, bt);
        let mut sim = Sim::new(total_blocks, bt);
        sim.swap = swap;
        for (id, &(prompt, max_new, _)) in seqs.iter().enumerate() {
            sim.submit(id as u64, prompt, max_new);
        }
        let work: usize = seqs.iter().map(|&(p, n, _)| p + n).sum();
        sim.run_to_end(lim, 1 + (seqs.len() + 1) * work);
        prop_assert_eq!(sim.free, total_blocks);
        prop_assert_eq!(sim.finished.len() + sim.rejected.len(), seqs.len());
        for id in &sim.rejected {
            let (prompt, max_new, _) = seqs[id.0 as usize];
            prop_assert!((prompt + max_new).div_ceil(bt) > total_blocks, "{id:?} ({prompt}+{max_new} tokens) fits {total_blocks} blocks of {bt} yet was rejected");
        }
    }
}
