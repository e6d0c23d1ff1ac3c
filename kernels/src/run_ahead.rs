//! Run-ahead decoding: a decode step's host work (emitting its tokens,
//! detokenizing, finishing sequences, planning) overlapped with the next step's
//! GPU work. The engine queues step N+1 before it has seen step N's tokens:
//! step N's greedy picks stay on the device ([`crate::Backend::greedy_rows_start`])
//! and step N+1 takes them as its tokens there ([`crate::Backend::decode_step_fed`]),
//! while the picks travel to the host in the background and are read when the
//! host gets to them ([`crate::Backend::greedy_rows_finish`]).
//!
//! What a backend shares here is pure bookkeeping, tested without a device: the
//! tickets of picks in flight and which of two host buffers each lands in
//! ([`PickQueue`]), and which device words a fed step copies ([`fed_runs`]).

/// Greedy picks queued by [`crate::Backend::greedy_rows_start`] and not yet read:
/// redeemed once, in the order they were started, with
/// [`crate::Backend::greedy_rows_finish`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "picks in flight hold one of the backend's two host buffers until finished"]
pub struct PendingPicks {
    pub(crate) ticket: u64,
    /// Rows picked.
    pub rows: usize,
}

/// Whether `BATON_RUN_AHEAD` leaves run-ahead decoding on (unset, `1`, `on`, `true`);
/// `0` makes every step wait for its tokens before the next is queued (A/B comparisons).
pub fn run_ahead_enabled() -> Result<bool, String> {
    match std::env::var("BATON_RUN_AHEAD").as_deref() {
        Err(_) | Ok("1") | Ok("on") | Ok("true") => Ok(true),
        Ok("0") | Ok("off") | Ok("false") => Ok(false),
        Ok(other) => Err(format!("BATON_RUN_AHEAD={other}: expected 1 or 0 (on or off)")),
    }
}

/// The picks in flight: at most two (step N's, being read, and step N+1's,
/// being computed), each in a host buffer of its own (`half`).
#[cfg(any(feature = "cuda", test))]
#[derive(Debug, Default)]
pub(crate) struct PickQueue {
    pending: std::collections::VecDeque<(u64, usize)>,
    next_ticket: u64,
    next_half: usize,
}

#[cfg(any(feature = "cuda", test))]
impl PickQueue {
    /// A ticket for new picks of `rows` rows and the host half they go to; `None`
    /// while both halves hold picks not yet read.
    pub fn start(&mut self, rows: usize) -> Option<(PendingPicks, usize)> {
        if !self.can_start() {
            return None;
        }
        let (ticket, half) = (self.next_ticket, self.next_half);
        self.next_ticket += 1;
        self.next_half = 1 - half;
        self.pending.push_back((ticket, half));
        Some((PendingPicks { ticket, rows }, half))
    }

    /// The half `picks` landed in, which is free again once read. Panics on picks
    /// finished out of order or not from this queue (an engine bug: the other half
    /// may already be overwritten).
    pub fn finish(&mut self, picks: PendingPicks) -> usize {
        match self.pending.front() {
            Some(&(ticket, half)) if ticket == picks.ticket => {
                self.pending.pop_front();
                half
            }
            front => panic!("picks {} finished out of order (oldest in flight: {front:?})", picks.ticket),
        }
    }

    /// Whether [`PickQueue::start`] would give a ticket now.
    pub fn can_start(&self) -> bool {
        self.pending.len() < 2
    }

    /// Whether `picks` are the latest started: the device holds only those.
    pub fn is_latest(&self, picks: &PendingPicks) -> bool {
        self.pending.back().is_some_and(|&(t, _)| t == picks.ticket)
    }
}

/// One copy of a fed step: `len` picks from `src` on into the step's tokens from row `dst` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FedRun {
    pub dst: usize,
    pub src: usize,
    pub len: usize,
}

/// The copies that give row `i` of a step the pick `from[i]`: consecutive rows
/// fed from consecutive picks are one copy (all of them when every row of the
/// last step goes on).
pub fn fed_runs(from: &[u32]) -> Vec<FedRun> {
    let mut runs: Vec<FedRun> = Vec::new();
    for (row, &src) in from.iter().enumerate() {
        let src = src as usize;
        match runs.last_mut() {
            Some(r) if r.dst + r.len == row && r.src + r.len == src => r.len += 1,
            _ => runs.push(FedRun { dst: row, src, len: 1 }),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_picks_in_flight_alternate_halves_and_finish_in_order() {
        let mut q = PickQueue::default();
        let (a, ha) = q.start(4).unwrap();
        let (b, hb) = q.start(3).unwrap();
        assert_ne!(ha, hb);
        assert!(q.start(1).is_none(), "both halves hold unread picks");
        assert!(q.is_latest(&b) && !q.is_latest(&a));
        assert_eq!(q.finish(a), ha);
        let (c, hc) = q.start(2).unwrap();
        assert_eq!(hc, ha, "the half read is the one refilled");
        assert_eq!(q.finish(b), hb);
        assert_eq!(q.finish(c), hc);
        assert!(q.start(1).is_some());
    }

    #[test]
    #[should_panic(expected = "out of order")]
    fn picks_finished_out_of_order_panic() {
        let mut q = PickQueue::default();
        let (_a, _) = q.start(1).unwrap();
        let (b, _) = q.start(1).unwrap();
        q.finish(b);
    }

    #[test]
    fn fed_rows_copy_in_runs() {
        assert_eq!(fed_runs(&[]), []);
        assert_eq!(fed_runs(&[0, 1, 2, 3]), [FedRun { dst: 0, src: 0, len: 4 }]);
        // Rows 1 and 4 of the last step ended: the rest go on, packed.
        assert_eq!(fed_runs(&[0, 2, 3, 5]), [FedRun { dst: 0, src: 0, len: 1 }, FedRun { dst: 1, src: 2, len: 2 }, FedRun { dst: 3, src: 5, len: 1 }]);
        assert_eq!(fed_runs(&[3, 2]), [FedRun { dst: 0, src: 3, len: 1 }, FedRun { dst: 1, src: 2, len: 1 }]);
    }
}
