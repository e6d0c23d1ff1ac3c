//! The "why this node" log: one record per routing decision, the last `capacity` kept.
//!
//! Records are looked up by conversation, but the log stores only its ring key (the
//! coordinator keeps no conversation IDs); [`ExplainLog::for_key`] hashes the query.

use std::collections::VecDeque;

use serde::Serialize;

use super::decode::{DecodeDecision, DecodeReason};
use super::prefill::{PrefillDecision, PrefillReason};
use baton_vocab::ConversationId;

use super::ring::key_of;

/// What kind of decision a record explains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionKind {
    Decode,
    Prefill,
}

/// Why, across both kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    Sticky,
    Home,
    Spilled,
    LocalShortTail,
    LocalPoolSaturated,
    LocalNoPrefillNodes,
    RemoteLeastLoaded,
    RemoteCachedPrefix,
    RemoteDecodeBusy,
}

impl Reason {
    /// A stable label (metrics, JSON).
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Sticky => "sticky",
            Reason::Home => "home",
            Reason::Spilled => "spilled",
            Reason::LocalShortTail => "local_short_tail",
            Reason::LocalPoolSaturated => "local_pool_saturated",
            Reason::LocalNoPrefillNodes => "local_no_prefill_nodes",
            Reason::RemoteLeastLoaded => "remote_least_loaded",
            Reason::RemoteCachedPrefix => "remote_cached_prefix",
            Reason::RemoteDecodeBusy => "remote_decode_busy",
        }
    }
}

impl From<DecodeReason> for Reason {
    fn from(r: DecodeReason) -> Self {
        match r {
            DecodeReason::Sticky => Reason::Sticky,
            DecodeReason::Home => Reason::Home,
            DecodeReason::Spilled => Reason::Spilled,
        }
    }
}

impl From<PrefillReason> for Reason {
    fn from(r: PrefillReason) -> Self {
        match r {
            PrefillReason::LocalShortTail => Reason::LocalShortTail,
            PrefillReason::LocalPoolSaturated => Reason::LocalPoolSaturated,
            PrefillReason::LocalNoPrefillNodes => Reason::LocalNoPrefillNodes,
            PrefillReason::RemoteLeastLoaded => Reason::RemoteLeastLoaded,
            PrefillReason::RemoteCachedPrefix => Reason::RemoteCachedPrefix,
            PrefillReason::RemoteDecodeBusy => Reason::RemoteDecodeBusy,
        }
    }
}

/// One node as a record shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CandidateRecord {
    pub node: String,
    pub load: f64,
    pub cached_tokens: u32,
    pub score: f64,
    pub eligible: bool,
}

/// One routing decision, explained.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExplainRecord {
    pub seq: u64,
    pub unix_ms: u64,
    pub kind: DecisionKind,
    /// The conversation's ring key; `None` for a turn outside any conversation.
    #[serde(skip)]
    pub key_hash: Option<u64>,
    pub candidates: Vec<CandidateRecord>,
    /// `None` for a local prefill.
    pub chosen: Option<String>,
    pub reason: Reason,
    pub load_bound: f64,
    pub prompt_tokens: u32,
    pub uncached_tokens: u32,
    pub threshold: u32,
}

impl ExplainRecord {
    /// A record of a decode decision.
    pub fn decode(conversation: &ConversationId, d: &DecodeDecision, prompt_tokens: u32, unix_ms: u64) -> Self {
        Self {
            seq: 0,
            unix_ms,
            kind: DecisionKind::Decode,
            key_hash: Some(key_of(conversation)),
            candidates: d
                .candidates
                .iter()
                .enumerate()
                .map(|(rank, c)| CandidateRecord {
                    node: c.node.clone(),
                    load: c.load as f64,
                    cached_tokens: 0,
                    score: rank as f64,
                    eligible: c.eligible,
                })
                .collect(),
            chosen: Some(d.node.clone()),
            reason: d.reason.into(),
            load_bound: d.bound as f64,
            prompt_tokens,
            uncached_tokens: 0,
            threshold: 0,
        }
    }

    /// A record of a prefill decision.
    pub fn prefill(
        conversation: Option<&ConversationId>,
        d: &PrefillDecision,
        prompt_tokens: u32,
        uncached_tokens: u32,
        threshold: u32,
        unix_ms: u64,
    ) -> Self {
        Self {
            seq: 0,
            unix_ms,
            kind: DecisionKind::Prefill,
            key_hash: conversation.map(key_of),
            candidates: d
                .candidates
                .iter()
                .map(|c| CandidateRecord {
                    node: c.candidate.node.clone(),
                    load: c.load,
                    cached_tokens: c.candidate.cached_tokens,
                    score: c.score,
                    eligible: c.eligible,
                })
                .collect(),
            chosen: d.remote.clone(),
            reason: d.reason.into(),
            load_bound: 0.0,
            prompt_tokens,
            uncached_tokens,
            threshold,
        }
    }
}

/// A bounded log of records, oldest dropped first.
#[derive(Debug)]
pub struct ExplainLog {
    capacity: usize,
    next_seq: u64,
    records: VecDeque<ExplainRecord>,
}

impl ExplainLog {
    pub fn new(capacity: usize) -> Self {
        Self { capacity: capacity.max(1), next_seq: 1, records: VecDeque::new() }
    }

    /// Appends a record, numbering it; returns its sequence number.
    pub fn push(&mut self, mut r: ExplainRecord) -> u64 {
        r.seq = self.next_seq;
        self.next_seq += 1;
        if self.records.len() == self.capacity {
            self.records.pop_front();
        }
        self.records.push_back(r);
        self.next_seq - 1
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The records for `conversation`, newest first, at most `limit` (0: all).
    pub fn for_key(&self, conversation: &ConversationId, limit: usize) -> Vec<ExplainRecord> {
        let h = Some(key_of(conversation));
        let limit = if limit == 0 { usize::MAX } else { limit };
        self.records.iter().rev().filter(|r| r.key_hash == h).take(limit).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::decode::DecodeCandidate;

    fn rec(key: &str) -> ExplainRecord {
        let d = DecodeDecision {
            node: "a".into(),
            reason: DecodeReason::Home,
            bound: 3,
            candidates: vec![DecodeCandidate { node: "a".into(), load: 1, eligible: true }],
            previous: None,
        };
        ExplainRecord::decode(&conv(key), &d, 10, 0)
    }

    fn conv(id: &str) -> ConversationId {
        ConversationId::parse(id).expect("a valid test conversation")
    }

    #[test]
    fn keeps_the_last_capacity_records_newest_first() {
        let mut log = ExplainLog::new(3);
        for k in ["x", "y", "x", "x"] {
            log.push(rec(k));
        }
        assert_eq!(log.len(), 3);
        let xs = log.for_key(&conv("x"), 0);
        assert_eq!(xs.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![4, 3]);
        assert_eq!(log.for_key(&conv("x"), 1).len(), 1);
        assert!(log.for_key(&conv("z"), 0).is_empty());
        let json = serde_json::to_value(&xs[0]).unwrap();
        assert_eq!(json["reason"], "home");
        assert_eq!(json["candidates"][0]["node"], "a");
    }
}
