//! The caller's handle on one reservation: progress, completion, cancel, and release on drop.
//!
//! Invariants: see [`super`]; a handle that is dropped before [`Reservation::finished`]
//! returned the blocks releases them.

use super::{Outcome, Reservation};
use crate::error::{Error, Result, Side};
use crate::handoff::grant::Grant;
use crate::types::{BlockId, ReservationId};

impl Reservation {
    /// What the sender needs: give it to the prefill node (see [`Grant::to_bytes`]).
    pub fn grant(&self) -> &Grant {
        &self.grant
    }

    pub fn id(&self) -> ReservationId {
        self.grant.reservation
    }

    /// Only a link whose peer certificate names `sender` may fill this reservation (the
    /// node the grant goes to); set it before handing the grant out.
    pub fn only_from(&self, sender: baton_identity::Expect) {
        *self.entry.sender.lock().unwrap_or_else(|p| p.into_inner()) = Some(sender);
    }

    /// Whether a sender's link opened this reservation (its `Open` frame was accepted): the
    /// transfer began, whatever became of it since. Tells a sender that failed while
    /// shipping from one that never got that far.
    pub fn transfer_began(&self) -> bool {
        self.entry.lock().attached
    }

    /// The reserved blocks, in reservation order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.grant.blocks
    }

    /// Layers fully installed, counted from the first reserved layer without gaps.
    pub fn ready_layers(&self) -> u32 {
        self.phase.borrow().ready_layers
    }

    /// Waits until at least `n` layers are ready; fails if the reservation ends first.
    pub async fn wait_ready_layers(&mut self, n: u32) -> Result<()> {
        loop {
            let p = *self.phase.borrow_and_update();
            match p.outcome {
                Some(Outcome::Failed(w)) => return Err(Error::from_wire(self.id(), w)),
                Some(Outcome::Completed) => return Ok(()),
                None if p.ready_layers >= n => return Ok(()),
                None => {}
            }
            self.changed().await?;
        }
    }

    /// Waits for the transfer to end. `Ok`: every block-layer was installed and the blocks
    /// now belong to the caller. `Err`: the blocks were already released.
    pub async fn finished(mut self) -> Result<Vec<BlockId>> {
        loop {
            let outcome = self.phase.borrow_and_update().outcome;
            match outcome {
                Some(Outcome::Completed) => {
                    let r = self.inner.take(&self.entry);
                    self.settled = r.is_ok();
                    return r;
                }
                Some(Outcome::Failed(w)) => {
                    self.settled = true;
                    return Err(Error::from_wire(self.id(), w));
                }
                None => self.changed().await?,
            }
        }
    }

    /// Gives up: releases the blocks now and tells the sender.
    pub fn cancel(mut self) {
        self.cancel_now();
    }

    fn cancel_now(&mut self) {
        if !self.settled {
            self.settled = true;
            self.inner.end(
                &self.entry,
                &Error::Cancelled {
                    reservation: self.id(),
                    by: Side::Receiver,
                },
            );
        }
    }

    async fn changed(&mut self) -> Result<()> {
        // The entry (which owns the sender half) lives as long as this handle.
        self.phase
            .changed()
            .await
            .map_err(|_| Error::ReservationEnded { reservation: self.grant.reservation })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.cancel_now();
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("id", &self.grant.reservation)
            .field("blocks", &self.grant.blocks.len())
            .field("layers", &self.grant.layers)
            .finish()
    }
}
