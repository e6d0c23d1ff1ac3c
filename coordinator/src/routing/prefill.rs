//! Prefill placement and conditional disaggregation.
//!
//! A decode node prefills the uncached tail itself when it is short (under
//! `local_threshold_tokens`) and the node has ITL headroom for it, when no prefill
//! node is registered, or when every prefill node is saturated (queue at `max_waiting`
//! or no free KV block). Otherwise the least loaded prefill node wins, with a credit for
//! one that already holds the conversation's prefix (it skips pulling that prefix from
//! the decode node).
//!
//! ITL headroom ([`DecodeHeadroom`], from the decode node's load report): the node's
//! planner prefills beside its running streams only what its step cost model fits
//! under its ITL target, and at least one KV block a step. A short tail is not the
//! node's own when that would hurt: its recent decode steps' p95 is already over the
//! target, the tokens its model fits beside the decode rows are fewer than the floor
//! (so every prefill step stretches the streams' gaps), or at that budget the tail
//! would take longer than `local_prefill_max_seconds` (the turn's first token would be
//! late). Then a prefill node with room (nothing waiting, fewer than
//! `busy_reroute_max_running` running) takes it, and the decode node only imports the
//! KV; with none, the decode node prefills it after all. A node that reports no ITL target is judged on the tail length alone.
//!
//! Pure: the caller gathers candidates and records the outcome.

/// The knobs of the prefill decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillPolicy {
    /// Tails shorter than this are prefilled on the decode node.
    pub local_threshold_tokens: u32,
    /// A prefill node with this many waiting sequences is saturated.
    pub max_waiting: u32,
    /// Score credit, in queued-sequence units, for holding the whole prefix.
    pub cache_credit: f64,
    /// Longest a decode node may take to prefill a short tail beside its streams
    /// (steps of its ITL target, each with its prefill budget) before the tail goes to
    /// a prefill node; half the seed's 1 s TTFT target, the rest left for queueing.
    pub local_prefill_max_seconds: f64,
    /// A short tail leaves a busy decode node only for a prefill node that reported
    /// nothing waiting and fewer running than this: "room" for work that would
    /// otherwise be done locally, judged on a report up to a keep-alive old, so that
    /// the prefill pool does not take on more short tails than it turns round.
    pub busy_reroute_max_running: u32,
}

impl Default for PrefillPolicy {
    fn default() -> Self {
        Self { local_threshold_tokens: 512, max_waiting: 8, cache_credit: 2.0, local_prefill_max_seconds: 0.5, busy_reroute_max_running: 4 }
    }
}

/// A decode node's ITL standing, as its load report gives it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DecodeHeadroom {
    /// Its ITL target, seconds (> 0).
    pub itl_target_seconds: f64,
    /// p95 of its recent decode steps, seconds (0: none lately).
    pub step_p95_seconds: f64,
    /// Prefill tokens per step its cost model fits beside the running decode rows.
    pub prefill_budget_tokens: u32,
    /// Its KV block's tokens: the least its planner prefills in a step.
    pub block_tokens: u32,
}

impl DecodeHeadroom {
    /// The standing a load report claims; `None` without a target (an older node, or
    /// one run without) or with numbers that are not times (NaN, infinite, negative):
    /// the tail length alone decides then.
    pub fn from_report(itl_target_seconds: f64, step_p95_seconds: f64, prefill_budget_tokens: u32, block_tokens: u32) -> Option<Self> {
        let time = |t: f64| t.is_finite() && t >= 0.0;
        (time(itl_target_seconds) && itl_target_seconds > 0.0 && time(step_p95_seconds))
            .then_some(DecodeHeadroom { itl_target_seconds, step_p95_seconds, prefill_budget_tokens, block_tokens: block_tokens.max(1) })
    }

    /// Seconds the node would take to prefill `tail` tokens beside its streams: one
    /// target-long step per budget's worth (at least a block).
    pub fn local_prefill_seconds(&self, tail: u32) -> f64 {
        let per_step = self.prefill_budget_tokens.max(self.block_tokens);
        f64::from(tail.div_ceil(per_step)) * self.itl_target_seconds
    }

    /// Whether prefilling `tail` here would stretch the node's streams past its target
    /// or take too long (see the module docs).
    pub fn busy_for(&self, tail: u32, policy: &PrefillPolicy) -> bool {
        self.step_p95_seconds > self.itl_target_seconds
            || self.prefill_budget_tokens < self.block_tokens.min(tail)
            || self.local_prefill_seconds(tail) > policy.local_prefill_max_seconds
    }
}

/// A prefill node as the decision sees it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PrefillCandidate {
    pub node: String,
    pub running: u32,
    pub waiting: u32,
    pub kv_blocks_free: u64,
    pub kv_blocks_total: u64,
    /// Prompt tokens of this conversation the node is believed to hold.
    pub cached_tokens: u32,
}

impl PrefillCandidate {
    fn saturated(&self, p: &PrefillPolicy) -> bool {
        self.waiting >= p.max_waiting || (self.kv_blocks_total > 0 && self.kv_blocks_free == 0)
    }

    /// Room for a short tail a busy decode node would otherwise prefill itself.
    fn has_room_for_short_tail(&self, p: &PrefillPolicy) -> bool {
        !self.saturated(p) && self.waiting == 0 && self.running < p.busy_reroute_max_running
    }

    fn load(&self) -> f64 {
        let used = if self.kv_blocks_total == 0 {
            0.0
        } else {
            1.0 - self.kv_blocks_free as f64 / self.kv_blocks_total as f64
        };
        f64::from(self.running) + f64::from(self.waiting) + used
    }
}

/// Why the prefill decision went the way it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillReason {
    LocalShortTail,
    LocalPoolSaturated,
    LocalNoPrefillNodes,
    RemoteLeastLoaded,
    RemoteCachedPrefix,
    /// A short tail, sent to a prefill node because the decode node lacks ITL headroom.
    RemoteDecodeBusy,
}

/// One candidate with the numbers the decision used.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ScoredCandidate {
    #[serde(flatten)]
    pub candidate: PrefillCandidate,
    pub load: f64,
    /// Lower is better.
    pub score: f64,
    pub eligible: bool,
}

/// The outcome of [`choose_prefill`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PrefillDecision {
    /// `None`: the decode node prefills locally.
    pub remote: Option<String>,
    pub reason: PrefillReason,
    pub candidates: Vec<ScoredCandidate>,
}

/// Decides where the `uncached_tokens` tail of a prompt is prefilled; `decode` is the
/// asking decode node's ITL standing, when it reports one.
pub fn choose_prefill(
    policy: &PrefillPolicy,
    prompt_tokens: u32,
    uncached_tokens: u32,
    decode: Option<DecodeHeadroom>,
    candidates: Vec<PrefillCandidate>,
) -> PrefillDecision {
    let scored: Vec<ScoredCandidate> = candidates
        .into_iter()
        .map(|c| {
            let load = c.load();
            let share = if prompt_tokens == 0 {
                0.0
            } else {
                f64::from(c.cached_tokens.min(prompt_tokens)) / f64::from(prompt_tokens)
            };
            let eligible = !c.saturated(policy);
            ScoredCandidate { score: load - policy.cache_credit * share, load, eligible, candidate: c }
        })
        .collect();
    let local = |reason, candidates| PrefillDecision { remote: None, reason, candidates };
    let short = uncached_tokens < policy.local_threshold_tokens;
    let decode_busy = uncached_tokens > 0 && decode.is_some_and(|d| d.busy_for(uncached_tokens, policy));
    let scored: Vec<ScoredCandidate> = if short && decode_busy {
        // Only a prefill node with room takes a short tail.
        scored.into_iter().map(|c| ScoredCandidate { eligible: c.candidate.has_room_for_short_tail(policy), ..c }).collect()
    } else {
        scored
    };
    if short && !decode_busy {
        return local(PrefillReason::LocalShortTail, scored);
    }
    if scored.is_empty() {
        return local(PrefillReason::LocalNoPrefillNodes, scored);
    }
    // Lowest score; ties go to the lower name so the choice is deterministic.
    let best = scored
        .iter()
        .filter(|c| c.eligible)
        .min_by(|a, b| a.score.total_cmp(&b.score).then_with(|| a.candidate.node.cmp(&b.candidate.node)));
    let Some(best) = best else {
        return local(PrefillReason::LocalPoolSaturated, scored);
    };
    // A node with part of the prefix won with its credit (or on load alone while also
    // holding the prefix): say so, since that is what the operator wants to see.
    let reason = if short {
        PrefillReason::RemoteDecodeBusy
    } else if best.candidate.cached_tokens > 0 {
        PrefillReason::RemoteCachedPrefix
    } else {
        PrefillReason::RemoteLeastLoaded
    };
    PrefillDecision { remote: Some(best.candidate.node.clone()), reason, candidates: scored }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cand(node: &str, running: u32, waiting: u32, cached: u32) -> PrefillCandidate {
        PrefillCandidate {
            node: node.into(),
            running,
            waiting,
            kv_blocks_free: 100,
            kv_blocks_total: 100,
            cached_tokens: cached,
        }
    }

    #[test]
    fn short_tail_is_prefilled_locally() {
        let d = choose_prefill(&PrefillPolicy::default(), 4000, 511, None, vec![cand("p", 0, 0, 0)]);
        assert_eq!((d.remote, d.reason), (None, PrefillReason::LocalShortTail));
        let d = choose_prefill(&PrefillPolicy::default(), 4000, 512, None, vec![cand("p", 0, 0, 0)]);
        assert_eq!(d.remote.as_deref(), Some("p"));
    }

    #[test]
    fn no_nodes_or_saturated_pool_means_local() {
        let p = PrefillPolicy::default();
        let d = choose_prefill(&p, 4000, 3000, None, vec![]);
        assert_eq!(d.reason, PrefillReason::LocalNoPrefillNodes);
        let mut full = cand("b", 1, 0, 0);
        full.kv_blocks_free = 0;
        let d = choose_prefill(&p, 4000, 3000, None, vec![cand("a", 1, 8, 0), full]);
        assert_eq!((d.remote, d.reason), (None, PrefillReason::LocalPoolSaturated));
    }

    #[test]
    fn least_loaded_wins_unless_another_holds_the_prefix() {
        let p = PrefillPolicy::default();
        let d = choose_prefill(&p, 4000, 3000, None, vec![cand("a", 2, 1, 0), cand("b", 1, 0, 0)]);
        assert_eq!((d.remote.as_deref(), d.reason), (Some("b"), PrefillReason::RemoteLeastLoaded));
        // a holds the whole prefix: credit 2 beats one extra running sequence.
        let d = choose_prefill(&p, 4000, 3000, None, vec![cand("a", 2, 0, 4000), cand("b", 1, 0, 0)]);
        assert_eq!((d.remote.as_deref(), d.reason), (Some("a"), PrefillReason::RemoteCachedPrefix));
        // ...but not three extra.
        let d = choose_prefill(&p, 4000, 3000, None, vec![cand("a", 4, 0, 4000), cand("b", 1, 0, 0)]);
        assert_eq!(d.remote.as_deref(), Some("b"));
    }

    fn headroom(p95_ms: f64, budget: u32) -> Option<DecodeHeadroom> {
        DecodeHeadroom::from_report(0.050, p95_ms / 1000.0, budget, 16)
    }

    #[test]
    fn a_decode_node_with_headroom_keeps_its_short_tails() {
        let p = PrefillPolicy::default();
        // Steps at 30 ms of a 50 ms target, 40 tokens a step: 110 tokens in 3 steps.
        let d = choose_prefill(&p, 4000, 110, headroom(30.0, 40), vec![cand("p", 0, 0, 0)]);
        assert_eq!((d.remote, d.reason), (None, PrefillReason::LocalShortTail));
        // A tail within one block fits a budget of that much.
        let d = choose_prefill(&p, 4000, 10, headroom(30.0, 10), vec![cand("p", 0, 0, 0)]);
        assert_eq!(d.reason, PrefillReason::LocalShortTail);
    }

    #[test]
    fn a_decode_node_without_headroom_sends_even_a_short_tail_to_a_prefill_node() {
        let p = PrefillPolicy::default();
        let prefill = || vec![cand("a", 2, 0, 0), cand("b", 1, 0, 0)];
        // Its steps are already over the target.
        let d = choose_prefill(&p, 4000, 110, headroom(62.0, 40), prefill());
        assert_eq!((d.remote.as_deref(), d.reason), (Some("b"), PrefillReason::RemoteDecodeBusy));
        // The decode rows leave less than a block: the planner's floor would stretch them.
        let d = choose_prefill(&p, 4000, 110, headroom(45.0, 15), prefill());
        assert_eq!((d.remote.as_deref(), d.reason), (Some("b"), PrefillReason::RemoteDecodeBusy));
        // Room for 16 tokens a step: 400 tokens take 25 steps, 1.25 s, over 0.5 s.
        let d = choose_prefill(&p, 4000, 400, headroom(40.0, 16), prefill());
        assert_eq!(d.remote.as_deref(), Some("b"));
        // ...while 144 take 9 steps, 0.45 s: local.
        let d = choose_prefill(&p, 4000, 144, headroom(40.0, 16), prefill());
        assert_eq!(d.remote, None);
    }

    #[test]
    fn without_a_prefill_node_with_room_a_busy_decode_node_prefills_anyway() {
        let p = PrefillPolicy::default();
        // Something waiting, or four running: no room for a short tail (a long one
        // still goes there).
        let d = choose_prefill(&p, 4000, 110, headroom(80.0, 0), vec![cand("a", 1, 1, 0), cand("b", 4, 0, 0)]);
        assert_eq!((d.remote, d.reason), (None, PrefillReason::LocalPoolSaturated));
        let d = choose_prefill(&p, 4000, 3000, headroom(80.0, 0), vec![cand("a", 1, 1, 0), cand("b", 4, 0, 0)]);
        assert_eq!(d.remote.as_deref(), Some("a"));
        let d = choose_prefill(&p, 4000, 110, headroom(80.0, 0), vec![]);
        assert_eq!((d.remote, d.reason), (None, PrefillReason::LocalNoPrefillNodes));
        let d = choose_prefill(&p, 4000, 110, headroom(80.0, 0), vec![cand("a", 1, 8, 0)]);
        assert_eq!((d.remote, d.reason), (None, PrefillReason::LocalPoolSaturated));
    }

    #[test]
    fn a_report_without_a_valid_target_is_judged_on_the_tail_alone() {
        for (target, p95) in [(0.0, 0.2), (f64::NAN, 0.2), (0.05, f64::INFINITY), (-1.0, 0.0), (0.05, -0.01)] {
            assert_eq!(DecodeHeadroom::from_report(target, p95, 0, 16), None, "{target} {p95}");
        }
        let d = choose_prefill(&PrefillPolicy::default(), 4000, 110, DecodeHeadroom::from_report(0.0, 9.0, 0, 16), vec![cand("p", 0, 0, 0)]);
        assert_eq!(d.reason, PrefillReason::LocalShortTail);
    }

    proptest! {
        /// The remote choice is never saturated and has the lowest score among the
        /// eligible; local only for the documented reasons: a short tail the decode node
        /// has headroom for, no prefill node, none with room.
        #[test]
        fn choice_is_minimal_and_eligible(
            nodes in prop::collection::vec((0u32..6, 0u32..12, 0u32..5000, 0u64..4), 0..6),
            uncached in 0u32..5000,
            decode in prop::option::of((0.0f64..0.1, 0u32..200)),
        ) {
            let p = PrefillPolicy::default();
            let cands: Vec<PrefillCandidate> = nodes.iter().enumerate().map(|(i, &(r, w, c, f))| PrefillCandidate {
                node: format!("p{i}"), running: r, waiting: w, kv_blocks_free: f, kv_blocks_total: 3, cached_tokens: c,
            }).collect();
            let decode = decode.and_then(|(p95, budget)| DecodeHeadroom::from_report(0.05, p95, budget, 16));
            let busy = uncached > 0 && decode.is_some_and(|d| d.busy_for(uncached, &p));
            let d = choose_prefill(&p, 5000, uncached, decode, cands);
            match &d.remote {
                None => {
                    let eligible = d.candidates.iter().any(|c| c.eligible);
                    prop_assert!((uncached < 512 && !busy) || d.candidates.is_empty() || !eligible);
                }
                Some(n) => {
                    prop_assert!(uncached >= 512 || busy);
                    prop_assert_eq!(d.reason == PrefillReason::RemoteDecodeBusy, uncached < 512);
                    let chosen = d.candidates.iter().find(|c| &c.candidate.node == n).unwrap();
                    prop_assert!(chosen.eligible);
                    if uncached < 512 {
                        prop_assert!(chosen.candidate.waiting == 0 && chosen.candidate.running < p.busy_reroute_max_running);
                    }
                    prop_assert!(d.candidates.iter().filter(|c| c.eligible).all(|c| c.score >= chosen.score));
                }
            }
        }
    }
}
