//! Prefill placement and conditional disaggregation.
//!
//! A decode node prefills the uncached tail itself when it is short (under
//! `local_threshold_tokens`), when no prefill node is registered, or when every prefill
//! node is saturated (queue at `max_waiting` or no free KV block). Otherwise the least
//! loaded prefill node wins, with a credit for one that already holds the conversation's
//! prefix (it skips pulling that prefix from the decode node).
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
}

impl Default for PrefillPolicy {
    fn default() -> Self {
        Self { local_threshold_tokens: 512, max_waiting: 8, cache_credit: 2.0 }
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

/// Decides where the `uncached_tokens` tail of a prompt is prefilled.
pub fn choose_prefill(
    policy: &PrefillPolicy,
    prompt_tokens: u32,
    uncached_tokens: u32,
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
    if uncached_tokens < policy.local_threshold_tokens {
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
    let reason = if best.candidate.cached_tokens > 0 {
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
        let d = choose_prefill(&PrefillPolicy::default(), 4000, 511, vec![cand("p", 0, 0, 0)]);
        assert_eq!((d.remote, d.reason), (None, PrefillReason::LocalShortTail));
        let d = choose_prefill(&PrefillPolicy::default(), 4000, 512, vec![cand("p", 0, 0, 0)]);
        assert_eq!(d.remote.as_deref(), Some("p"));
    }

    #[test]
    fn no_nodes_or_saturated_pool_means_local() {
        let p = PrefillPolicy::default();
        let d = choose_prefill(&p, 4000, 3000, vec![]);
        assert_eq!(d.reason, PrefillReason::LocalNoPrefillNodes);
        let mut full = cand("b", 1, 0, 0);
        full.kv_blocks_free = 0;
        let d = choose_prefill(&p, 4000, 3000, vec![cand("a", 1, 8, 0), full]);
        assert_eq!((d.remote, d.reason), (None, PrefillReason::LocalPoolSaturated));
    }

    #[test]
    fn least_loaded_wins_unless_another_holds_the_prefix() {
        let p = PrefillPolicy::default();
        let d = choose_prefill(&p, 4000, 3000, vec![cand("a", 2, 1, 0), cand("b", 1, 0, 0)]);
        assert_eq!((d.remote.as_deref(), d.reason), (Some("b"), PrefillReason::RemoteLeastLoaded));
        // a holds the whole prefix: credit 2 beats one extra running sequence.
        let d = choose_prefill(&p, 4000, 3000, vec![cand("a", 2, 0, 4000), cand("b", 1, 0, 0)]);
        assert_eq!((d.remote.as_deref(), d.reason), (Some("a"), PrefillReason::RemoteCachedPrefix));
        // ...but not three extra.
        let d = choose_prefill(&p, 4000, 3000, vec![cand("a", 4, 0, 4000), cand("b", 1, 0, 0)]);
        assert_eq!(d.remote.as_deref(), Some("b"));
    }

    proptest! {
        /// The remote choice is never saturated and has the lowest score among the
        /// eligible; local only for the three documented reasons.
        #[test]
        fn choice_is_minimal_and_eligible(
            nodes in prop::collection::vec((0u32..6, 0u32..12, 0u32..5000, 0u64..4), 0..6),
            uncached in 0u32..5000,
        ) {
            let p = PrefillPolicy::default();
            let cands: Vec<PrefillCandidate> = nodes.iter().enumerate().map(|(i, &(r, w, c, f))| PrefillCandidate {
                node: format!("p{i}"), running: r, waiting: w, kv_blocks_free: f, kv_blocks_total: 3, cached_tokens: c,
            }).collect();
            let d = choose_prefill(&p, 5000, uncached, cands);
            match &d.remote {
                None => {
                    let eligible = d.candidates.iter().any(|c| c.eligible);
                    prop_assert!(uncached < 512 || d.candidates.is_empty() || !eligible);
                }
                Some(n) => {
                    prop_assert!(uncached >= 512);
                    let chosen = d.candidates.iter().find(|c| &c.candidate.node == n).unwrap();
                    prop_assert!(chosen.eligible);
                    prop_assert!(d.candidates.iter().filter(|c| c.eligible).all(|c| c.score >= chosen.score));
                }
            }
        }
    }
}
