//! Proof of transfer: where a turn's prompt KV came from, and why. Pure.
//!
//! A turn's `Generate` gathers [`Facts`] on its way to the engine (what the prefix cache
//! held, whether a moved conversation's prefix was pulled, where the coordinator routed
//! the tail and what became of a remote prefill); the engine then says whether it used
//! the KV that arrived ([`ImportUse`]). [`classify`] turns both into one
//! (outcome, reason) pair, which the node counts (`baton_decode_kv_source_total`) and
//! sends to the gateway on the turn's first token (`GenerateEvent.kv_source`).
//!
//! Precedence, first match wins (docs/metrics.md has the table):
//! 1. A remote prefill that did not deliver, or whose KV the engine refused:
//!    `recomputed` with the handoff's reason.
//! 2. A remote prefill whose KV the engine used: `imported`.
//! 3. A moved conversation whose prefix pull failed: `recomputed{pull_failed}`; pulled:
//!    `pulled`.
//! 4. Any prefix found in this node's cache: `warm`.
//! 5. Nothing found, though this node served the conversation's last turn:
//!    `recomputed{evicted}`.
//! 6. Otherwise `recomputed` with why the tail stayed here (`local_policy`,
//!    `no_prefill_pool`, `coordinator_unavailable`).
//!
//! Invariant: every result is one of `baton_proto::kv_source::PAIRS` (tested).

use baton_engine::ImportUse;
use baton_proto::node::{KvOutcome, KvReason, KvSource};

/// Why a tail was prefilled on this node without asking a prefill node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalWhy {
    /// The prefix cache held the whole prompt (but the token the engine computes itself).
    NothingToPrefill,
    /// The coordinator chose local prefill (a short tail, a saturated pool, no prefill
    /// node), or this node does: it lacks its platform prefix, which no imported tail may
    /// cover (a prefill node could otherwise plant the KV every user's turn reads).
    Policy,
    /// No coordinator and no `--prefill-addr`: this node prefills every tail.
    NoPrefillPool,
    /// No coordinator answered `RoutePrefill` in time.
    CoordinatorUnavailable,
}

/// What became of a moved conversation's prefix pull.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pull {
    /// None was needed (the conversation did not move, or this node held enough).
    #[default]
    None,
    /// Blocks were pulled from the previous owner.
    Pulled,
    /// The pull failed; the prefix is computed here.
    Failed,
}

/// Where the tail went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routed {
    Local(LocalWhy),
    /// A prefill node was asked: `Ok` when its KV arrived here, else why not
    /// (a `recomputed` reason, see [`crate::error::Error::reason`]).
    Remote(Result<(), KvReason>),
}

/// What a turn learned before the engine took it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Facts {
    /// Prompt tokens this node's prefix cache held (after any pull).
    pub cached: usize,
    pub pull: Pull,
    /// This node served the conversation's previous turn, which shares at least one whole
    /// block with this prompt (its warm table knows it).
    pub served_before: bool,
    pub routed: Routed,
}

impl Facts {
    /// The engine refused the import at submission: the tail is recomputed here.
    pub fn import_refused(&mut self) {
        self.routed = Routed::Remote(Err(KvReason::ImportRefused));
    }

    /// Whether a prefill node was asked for the tail.
    pub fn went_remote(&self) -> bool {
        matches!(self.routed, Routed::Remote(_))
    }
}

/// The turn's KV source, given what the engine did with the import (`None`: there was none,
/// or the engine never said).
pub fn classify(f: &Facts, import: Option<ImportUse>) -> KvSource {
    use KvOutcome as O;
    use KvReason as R;
    let (outcome, reason) = match f.routed {
        Routed::Remote(Err(reason)) => (O::Recomputed, reason),
        Routed::Remote(Ok(())) if import == Some(ImportUse::Used) => (O::Imported, R::RemotePrefill),
        Routed::Remote(Ok(())) => (O::Recomputed, R::ImportRefused),
        Routed::Local(why) => match (f.pull, f.cached > 0, f.served_before, why) {
            (Pull::Failed, ..) => (O::Recomputed, R::PullFailed),
            (Pull::Pulled, ..) => (O::Pulled, R::MovedConversation),
            (Pull::None, true, ..) => (O::Warm, R::PrefixCache),
            (Pull::None, false, true, _) => (O::Recomputed, R::Evicted),
            (Pull::None, false, false, LocalWhy::NoPrefillPool) => (O::Recomputed, R::NoPrefillPool),
            (Pull::None, false, false, LocalWhy::CoordinatorUnavailable) => (O::Recomputed, R::CoordinatorUnavailable),
            // Nothing cached leaves a tail to prefill, so `NothingToPrefill` cannot meet it.
            (Pull::None, false, false, LocalWhy::Policy | LocalWhy::NothingToPrefill) => (O::Recomputed, R::LocalPolicy),
        },
    };
    KvSource { outcome: outcome as i32, reason: reason as i32 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_proto::kv_source::{labels, PAIRS, UNKNOWN};

    fn facts(cached: usize, pull: Pull, served_before: bool, routed: Routed) -> Facts {
        Facts { cached, pull, served_before, routed }
    }

    fn label(f: Facts, import: Option<ImportUse>) -> (&'static str, &'static str) {
        labels(&classify(&f, import))
    }

    #[test]
    fn the_precedence_of_the_module_docs() {
        use LocalWhy::*;
        let remote_ok = Routed::Remote(Ok(()));
        // 1. A handoff that failed, or KV the engine did not use, is recomputed.
        let failed = Routed::Remote(Err(KvReason::TransferFailed));
        assert_eq!(label(facts(64, Pull::Pulled, true, failed), None), ("recomputed", "transfer_failed"));
        assert_eq!(label(facts(0, Pull::None, false, remote_ok), Some(ImportUse::NotContiguous)), ("recomputed", "import_refused"));
        assert_eq!(label(facts(0, Pull::None, false, remote_ok), Some(ImportUse::NoWindowMemory)), ("recomputed", "import_refused"));
        assert_eq!(label(facts(0, Pull::None, false, remote_ok), None), ("recomputed", "import_refused"), "the engine never said");
        let mut f = facts(0, Pull::None, false, remote_ok);
        f.import_refused();
        assert_eq!(label(f, None), ("recomputed", "import_refused"));
        // 2. Imported, even over a failed pull or a warm prefix.
        assert_eq!(label(facts(32, Pull::Failed, true, remote_ok), Some(ImportUse::Used)), ("imported", "remote_prefill"));
        // 3. Pulls.
        assert_eq!(label(facts(32, Pull::Failed, false, Routed::Local(Policy)), None), ("recomputed", "pull_failed"));
        assert_eq!(label(facts(32, Pull::Pulled, false, Routed::Local(Policy)), None), ("pulled", "moved_conversation"));
        // 4. Warm, whatever kept the tail here.
        for why in [NothingToPrefill, Policy, NoPrefillPool, CoordinatorUnavailable] {
            assert_eq!(label(facts(16, Pull::None, true, Routed::Local(why)), None), ("warm", "prefix_cache"));
        }
        // 5. Evicted.
        assert_eq!(label(facts(0, Pull::None, true, Routed::Local(Policy)), None), ("recomputed", "evicted"));
        // 6. Why the tail stayed here.
        assert_eq!(label(facts(0, Pull::None, false, Routed::Local(Policy)), None), ("recomputed", "local_policy"));
        assert_eq!(label(facts(0, Pull::None, false, Routed::Local(NoPrefillPool)), None), ("recomputed", "no_prefill_pool"));
        assert_eq!(label(facts(0, Pull::None, false, Routed::Local(CoordinatorUnavailable)), None), ("recomputed", "coordinator_unavailable"));
    }

    #[test]
    fn every_result_is_a_listed_pair() {
        use LocalWhy::*;
        let reasons = [
            KvReason::ReserveFailed,
            KvReason::PrefillNodeUnavailable,
            KvReason::PrefillFailed,
            KvReason::TransferFailed,
            KvReason::Deadline,
            KvReason::ImportRefused,
        ];
        let mut routes: Vec<Routed> = [NothingToPrefill, Policy, NoPrefillPool, CoordinatorUnavailable].into_iter().map(Routed::Local).collect();
        routes.push(Routed::Remote(Ok(())));
        routes.extend(reasons.into_iter().map(|r| Routed::Remote(Err(r))));
        let mut seen = std::collections::BTreeSet::new();
        for routed in routes {
            for pull in [Pull::None, Pull::Pulled, Pull::Failed] {
                for cached in [0, 16] {
                    for served_before in [false, true] {
                        for import in [None, Some(ImportUse::Used), Some(ImportUse::NotContiguous)] {
                            let got = label(facts(cached, pull, served_before, routed), import);
                            assert_ne!(got, UNKNOWN, "{routed:?} {pull:?} {cached} {served_before} {import:?}");
                            seen.insert(got);
                        }
                    }
                }
            }
        }
        let all: std::collections::BTreeSet<_> = PAIRS.iter().copied().collect();
        assert_eq!(seen, all, "every listed pair is reachable");
    }
}
