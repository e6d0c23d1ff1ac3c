//! The scheduler's planning rules, apart from the model and the KV arena.
//!
//! [`plan_step`] decides one engine step. It sees the queues only through
//! [`Queues`], which the worker implements over its sequences and the block
//! cache, and the tests implement over a simulated block pool: every rule
//! below is tested without a model. Planning is synchronous and
//! deterministic; the calls it makes into [`Queues`] (and so the order in
//! which the cache allocates and evicts) depend only on the queue state.
//!
//! The rules, in order:
//! 1. Decode first: each running sequence with exactly one pending token gets
//!    one row while the token budget lasts. When its next block cannot be had,
//!    the most recently admitted running sequence not already in this step is
//!    preempted (itself if every other one is), and planning starts over.
//! 2. Prefill chunks of running sequences, in admission order, as far as the
//!    budget and the blocks they hold allow. In a step with decode rows the
//!    prefill tokens (this rule's and the next's together) are held to the
//!    prefill budget: what the engine's cost model says fits beside those
//!    rows under the ITL target. So a long prompt is split into chunks no
//!    running stream notices, and a new turn waits for budget rather than
//!    stretch the streams' steps. Without decode rows the whole step budget
//!    is prefill's.
//!    Prefill never starves: the prefill budget is raised to one KV block when
//!    it is smaller (zero when decode rows alone reach the target). A floor
//!    rather than an age rule: it keeps planning a function of the queues
//!    alone (no clock), bounds how long a prompt can wait (one block per step)
//!    and what it costs the streams (one block's tokens per step, a few ms on
//!    a CPU), where an age rule would let a starved prompt in all at once.
//! 3. Admission from the head of the queue (preempted sequences go back to
//!    the head) while budget and `max_running` allow. The first that cannot
//!    start stops admission: no later arrival jumps ahead of it.
//! 4. Nothing to run, nothing running and a non-empty queue: the head can
//!    never fit, even alone, and is rejected rather than retried forever.
//! 5. Nothing to run but several running sequences (prefills each waiting for
//!    the window layers' memory of a grouped arena that the others hold): the
//!    most recently admitted is preempted, so the rest can go on. One sequence
//!    alone always can: the engine refuses an arena a max-context sequence
//!    does not fit alone.

use crate::kv::SeqId;

/// Where one running sequence stands, as planning needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SeqProgress {
    pub id: SeqId,
    /// Prompt plus generated tokens.
    pub tokens: usize,
    /// Tokens whose KV is in its blocks.
    pub computed: usize,
    /// KV blocks it holds.
    pub blocks: usize,
}

impl SeqProgress {
    /// Tokens still to feed through the model before the next sample.
    pub fn pending(&self) -> usize {
        self.tokens - self.computed
    }
}

/// What became of the head of the waiting queue when it was offered a start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// It holds blocks for its prompt and is now the last running sequence.
    Running,
    /// It finished on admission (an imported first token ended it).
    Finished,
    /// No blocks for it now; it stays at the head of the queue.
    NoRoom,
}

/// The running and waiting queues as planning sees and changes them.
///
/// Running sequences are indexed in admission order; every method that
/// removes one shifts the indices after it.
pub(crate) trait Queues {
    fn running_len(&self) -> usize;
    fn progress(&self, running: usize) -> SeqProgress;
    fn has_waiting(&self) -> bool;
    /// Gives running sequence `running` blocks for its first `upto` tokens;
    /// false (and nothing taken) when they cannot be had.
    fn grow(&mut self, running: usize, upto: usize) -> bool;
    /// Parks running sequence `running` at the head of the waiting queue,
    /// giving back (or swapping out) its blocks.
    fn preempt(&mut self, running: usize);
    /// Offers the head of the waiting queue a start (see [`Admission`]).
    fn admit_head(&mut self) -> Admission;
    /// Parks the last admitted running sequence at the head of the queue, as
    /// [`Queues::preempt`] does (it was admitted but its first chunk's blocks
    /// could not be had).
    fn requeue_last(&mut self);
}

/// The limits one step is planned under.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Tokens one step may process (decode rows plus prefill chunks); > 0.
    pub step_token_budget: usize,
    /// Prefill tokens a step with decode rows may add beside them (raised to
    /// `block_tokens` when smaller; see rule 2). `usize::MAX`: no limit but
    /// the step budget.
    pub prefill_token_budget: usize,
    /// Most running sequences.
    pub max_running: usize,
    /// Tokens per KV block; > 0.
    pub block_tokens: usize,
}

/// One sequence's share of a step: tokens `start..start + len` of running
/// sequence `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slice {
    pub seq: usize,
    pub start: usize,
    pub len: usize,
    /// The chunk reaches the sequence's last token: sample after it.
    pub wants_logits: bool,
}

/// The decisions of one step. Indices in `slices` are into the running
/// queue as it stands after planning.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct StepPlan {
    pub slices: Vec<Slice>,
    /// Sequences preempted while planning, in order.
    pub preempted: Vec<SeqId>,
    /// Sequences admitted from the queue this step, in order.
    pub admitted: Vec<SeqId>,
    /// The head of the queue can never get blocks: fail it.
    pub reject_head: bool,
}

impl StepPlan {
    /// Tokens the step processes.
    pub fn tokens(&self) -> usize {
        self.slices.iter().map(|s| s.len).sum()
    }
}

/// Plans one step (see the module docs for the rules).
pub(crate) fn plan_step(q: &mut impl Queues, limits: Limits) -> StepPlan {
    let mut plan = StepPlan::default();
    let mut budget = plan_decodes(q, limits, &mut plan);
    if !plan.slices.is_empty() {
        // Every slice so far is a decode row.
        budget = budget.min(prefill_allowance(limits));
    }
    plan_running_prefills(q, limits, &mut budget, &mut plan.slices);
    admit(q, limits, &mut budget, &mut plan);
    plan.reject_head = plan.slices.is_empty() && q.running_len() == 0 && q.has_waiting();
    if plan.slices.is_empty() && q.running_len() > 1 {
        // Rule 5: running prefills all wait for memory the others hold.
        let last = q.running_len() - 1;
        plan.preempted.push(q.progress(last).id);
        q.preempt(last);
    }
    plan
}

/// Prefill tokens a step with decode rows may take: the prefill budget, at
/// least one KV block (rule 2's floor).
pub(crate) fn prefill_allowance(limits: Limits) -> usize {
    limits.prefill_token_budget.max(limits.block_tokens)
}

/// Rule 1; returns the budget left.
fn plan_decodes(q: &mut impl Queues, limits: Limits, plan: &mut StepPlan) -> usize {
    'replan: loop {
        let mut budget = limits.step_token_budget;
        plan.slices.clear();
        let mut i = 0;
        while i < q.running_len() {
            let s = q.progress(i);
            if s.pending() != 1 || budget == 0 {
                i += 1;
                continue;
            }
            if q.grow(i, s.computed + 1) {
                plan.slices.push(Slice { seq: i, start: s.computed, len: 1, wants_logits: true });
                budget -= 1;
                i += 1;
                continue;
            }
            // Never a row already planned: it holds the block it was just given.
            let in_step: Vec<SeqId> = plan.slices.iter().map(|sl| q.progress(sl.seq).id).collect();
            let victim = (0..q.running_len()).rev().find(|&j| j != i && !in_step.contains(&q.progress(j).id)).unwrap_or(i);
            plan.preempted.push(q.progress(victim).id);
            q.preempt(victim);
            // Indices after the removal shifted, and budget was spent on rows
            // that may now come in another order: plan again from the start.
            continue 'replan;
        }
        return budget;
    }
}

/// Rule 2: running sequences reserved blocks for their whole prompt at
/// admission, so a chunk allocates no blocks; in a grouped arena its `grow` still
/// takes the window layers' memory of the blocks it reaches, and a chunk that cannot
/// have it waits (rule 5).
fn plan_running_prefills(q: &mut impl Queues, limits: Limits, budget: &mut usize, slices: &mut Vec<Slice>) {
    for i in 0..q.running_len() {
        if *budget == 0 {
            break;
        }
        let s = q.progress(i);
        if s.pending() > 1 {
            let len = s.pending().min(*budget);
            if (s.computed + len).div_ceil(limits.block_tokens) <= s.blocks && q.grow(i, s.computed + len) {
                slices.push(Slice { seq: i, start: s.computed, len, wants_logits: s.computed + len == s.tokens });
                *budget -= len;
            }
        }
    }
}

/// Rule 3.
fn admit(q: &mut impl Queues, limits: Limits, budget: &mut usize, plan: &mut StepPlan) {
    while *budget > 0 && q.running_len() < limits.max_running && q.has_waiting() {
        match q.admit_head() {
            Admission::NoRoom => break,
            Admission::Finished => continue,
            Admission::Running => {}
        }
        let idx = q.running_len() - 1;
        let s = q.progress(idx);
        let len = s.pending().min(*budget);
        if !q.grow(idx, s.computed + len) {
            // Blocks for the whole prompt come with admission; only a
            // swapped-in sequence can get here. It is parked again.
            q.requeue_last();
            break;
        }
        plan.admitted.push(s.id);
        plan.slices.push(Slice { seq: idx, start: s.computed, len, wants_logits: s.computed + len == s.tokens });
        *budget -= len;
    }
}


#[cfg(test)]
mod tests;
