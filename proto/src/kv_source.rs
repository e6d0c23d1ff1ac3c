//! Proof of transfer on the wire: where a turn's prompt KV came from ([`KvSource`], sent by
//! the decode node on the turn's first token event) as the metric labels both the decode
//! node (`baton_decode_kv_source_total`) and the gateway (`baton_gateway_kv_source_total`)
//! count it under.
//!
//! Owns: [`PAIRS`], the one list of valid (outcome, reason) label pairs, and [`labels`], the
//! one mapping from the wire's enums to them. Invariants: labels are a small fixed set; a
//! value a peer sends that is not a valid pair (an unknown enum number, a reason that does
//! not go with its outcome) becomes `("unknown", "unknown")`, never a new series.

use crate::node::{KvOutcome, KvReason, KvSource};

/// Every valid (outcome, reason) pair, as metric labels.
pub const PAIRS: &[(&str, &str)] = &[
    ("imported", "remote_prefill"),
    ("pulled", "moved_conversation"),
    ("warm", "prefix_cache"),
    ("recomputed", "local_policy"),
    ("recomputed", "no_prefill_pool"),
    ("recomputed", "coordinator_unavailable"),
    ("recomputed", "evicted"),
    ("recomputed", "reserve_failed"),
    ("recomputed", "prefill_node_unavailable"),
    ("recomputed", "prefill_failed"),
    ("recomputed", "transfer_failed"),
    ("recomputed", "deadline"),
    ("recomputed", "import_refused"),
    ("recomputed", "pull_failed"),
];

/// What a peer's [`KvSource`] counts as when it is not a valid pair.
pub const UNKNOWN: (&str, &str) = ("unknown", "unknown");

/// The label of an outcome (`None` for unspecified).
pub fn outcome_label(o: KvOutcome) -> Option<&'static str> {
    Some(match o {
        KvOutcome::Unspecified => return None,
        KvOutcome::Imported => "imported",
        KvOutcome::Pulled => "pulled",
        KvOutcome::Warm => "warm",
        KvOutcome::Recomputed => "recomputed",
    })
}

/// The label of a reason (`None` for unspecified).
pub fn reason_label(r: KvReason) -> Option<&'static str> {
    Some(match r {
        KvReason::Unspecified => return None,
        KvReason::RemotePrefill => "remote_prefill",
        KvReason::MovedConversation => "moved_conversation",
        KvReason::PrefixCache => "prefix_cache",
        KvReason::LocalPolicy => "local_policy",
        KvReason::NoPrefillPool => "no_prefill_pool",
        KvReason::CoordinatorUnavailable => "coordinator_unavailable",
        KvReason::Evicted => "evicted",
        KvReason::ReserveFailed => "reserve_failed",
        KvReason::PrefillNodeUnavailable => "prefill_node_unavailable",
        KvReason::PrefillFailed => "prefill_failed",
        KvReason::TransferFailed => "transfer_failed",
        KvReason::Deadline => "deadline",
        KvReason::ImportRefused => "import_refused",
        KvReason::PullFailed => "pull_failed",
    })
}

/// The (outcome, reason) labels of a source as it came off the wire: one of [`PAIRS`], or
/// [`UNKNOWN`].
pub fn labels(s: &KvSource) -> (&'static str, &'static str) {
    let outcome = KvOutcome::try_from(s.outcome).ok().and_then(outcome_label);
    let reason = KvReason::try_from(s.reason).ok().and_then(reason_label);
    match (outcome, reason) {
        (Some(o), Some(r)) if PAIRS.contains(&(o, r)) => (o, r),
        _ => UNKNOWN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pair_round_trips_and_nothing_else_is_a_label() {
        let mut seen = Vec::new();
        for o in 0..=5 {
            for r in 0..=16 {
                let got = labels(&KvSource { outcome: o, reason: r });
                if got != UNKNOWN {
                    seen.push(got);
                }
            }
        }
        seen.sort();
        let mut want = PAIRS.to_vec();
        want.sort();
        assert_eq!(seen, want, "exactly the listed pairs map to labels");
        assert_eq!(labels(&KvSource { outcome: 99, reason: 11 }), UNKNOWN);
        assert_eq!(labels(&KvSource { outcome: KvOutcome::Warm as i32, reason: KvReason::TransferFailed as i32 }), UNKNOWN, "a reason must go with its outcome");
        assert_eq!(labels(&KvSource::default()), UNKNOWN);
    }
}
