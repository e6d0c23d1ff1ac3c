//! Installing frames: the Open frame that attaches a link to a reservation (checked
//! against the grant's identity, the layout and the reserved range), then each data frame
//! verified and written into the reservation's blocks under its lock, and the Done frame
//! that completes it (or the sender's Cancel). A frame that fails a check ends the
//! reservation (invariants: see [`super`]).

use super::*;

impl Inner {
    pub(super) fn accept_open(&self, f: &Frame, peer: Option<&baton_identity::Identity>) -> Result<Arc<Entry>> {
        let h = f.header;
        // The kind first: a link's first frame is refused for what it is, whatever its
        // payload (a byte-stream transport refuses a data payload before reading it).
        if h.kind != FrameKind::Open {
            return Err(Error::UnexpectedFrame {
                reservation: h.reservation,
                what: h.kind.name(),
            });
        }
        if !f.verify() {
            return Err(Error::FrameChecksum {
                reservation: h.reservation,
                layer: h.layer,
                block: h.first_block,
            });
        }
        let entry = self.lookup(h.reservation, h.epoch)?;
        // A grant is for the node it was issued to: another certificate that learned it is
        // refused without ending the reservation (the right sender may still come).
        if let Some(expect) = entry.sender.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            if !peer.is_some_and(|id| expect.admits(id)) {
                tracing::warn!(reservation = h.reservation.0, ?peer, %expect, "a link from another identity tried to fill a grant");
                return Err(Error::InvalidArgument { what: "the grant was issued to another node" });
            }
        }
        let mismatch = match f.open_layout() {
            Ok(l) if l != self.layout => Some("layout"),
            Err(_) => Some("layout"),
            Ok(_) if h.layer != entry.layers.start || h.aux != entry.layers.end => {
                Some("layer range")
            }
            Ok(_) if h.block_count as usize != entry.blocks.len() => Some("block count"),
            Ok(_) => None,
        };
        let mut st = entry.lock();
        match st.status {
            Status::Open => {}
            Status::Ended(w) => return Err(Error::from_wire(h.reservation, w)),
            Status::Completed | Status::Taken => {
                return Err(Error::ReservationEnded {
                    reservation: h.reservation,
                })
            }
        }
        if st.attached {
            // Another link owns it; this one must not disturb it.
            return Err(Error::AlreadyAttached {
                reservation: h.reservation,
            });
        }
        if let Some(what) = mismatch {
            drop(st);
            let e = Error::LayoutMismatch {
                reservation: h.reservation,
                what,
            };
            self.end(&entry, &e);
            return Err(e);
        }
        st.attached = true;
        drop(st);
        Ok(entry)
    }

    pub(super) fn on_frame(&self, entry: &Entry, frame: Frame, ls: &TransportStats) -> Step {
        self.stats.add_frame(frame.wire_len());
        ls.add_frame(frame.wire_len());
        let step = self.on_verified_frame(entry, frame, ls);
        match step {
            Step::Failed(w) => {
                ls.add(&ls.rejected_frames, 1);
                let kind = KINDS.get(usize::from(w.code)).map_or(0, |_| usize::from(w.code));
                ls.add(&ls.failures[kind], 1);
            }
            Step::Completed => ls.record_transfer(entry.created.elapsed()),
            Step::Continue | Step::CancelledBySender => {}
        }
        step
    }

    fn on_verified_frame(&self, entry: &Entry, frame: Frame, ls: &TransportStats) -> Step {
        let h = frame.header;
        if !frame.verify() {
            return self.reject(
                entry,
                Error::FrameChecksum {
                    reservation: entry.id,
                    layer: h.layer,
                    block: h.first_block,
                },
            );
        }
        if h.reservation != entry.id || h.epoch != self.epoch {
            return self.unexpected(entry, "frame naming another reservation");
        }
        match h.kind {
            FrameKind::Data => {
                let step = self.install(entry, &frame);
                if matches!(step, Step::Continue) {
                    ls.add(&ls.block_layers, u64::from(h.block_count));
                }
                step
            }
            FrameKind::Done => self.complete(entry),
            FrameKind::Cancel => {
                self.end(
                    entry,
                    &Error::Cancelled {
                        reservation: entry.id,
                        by: Side::Sender,
                    },
                );
                Step::CancelledBySender
            }
            other => self.unexpected(entry, other.name()),
        }
    }

    /// Rejects a frame of a kind this reservation cannot take now.
    fn unexpected(&self, entry: &Entry, what: &'static str) -> Step {
        self.reject(entry, Error::UnexpectedFrame { reservation: entry.id, what })
    }

    fn reject(&self, entry: &Entry, e: Error) -> Step {
        self.stats.add(&self.stats.rejected_frames, 1);
        tracing::info!(reservation = entry.id.0, kind = e.label(), error = %e, "frame rejected");
        Step::Failed(self.end(entry, &e))
    }

    fn install(&self, entry: &Entry, frame: &Frame) -> Step {
        let h = frame.header;
        let mut st = entry.lock();
        match st.status {
            Status::Open => {}
            Status::Ended(w) => {
                self.stats.add(&self.stats.rejected_frames, 1);
                return Step::Failed(w);
            }
            Status::Completed | Status::Taken => {
                drop(st);
                return self.unexpected(entry, "data after done");
            }
        }
        if let Err(e) = st.progress.admit(entry.id, h.layer, h.first_block, h.block_count) {
            drop(st);
            return self.reject(entry, e);
        }
        let bl = self.layout.bytes_per_block_layer();
        if frame.payload_len() != h.block_count as usize * bl {
            drop(st);
            return self.reject(
                entry,
                Error::LayoutMismatch {
                    reservation: entry.id,
                    what: "payload length",
                },
            );
        }
        let first = h.first_block as usize;
        let written = match &frame.device {
            None => self.write_host(&entry.blocks[first..], h.layer, &frame.payload),
            Some(d) => self.write_device(&entry.blocks[first..], h.layer, d),
        };
        if let Err(e) = written {
            drop(st);
            return self.reject(entry, e);
        }
        st.progress.record(h.layer, h.first_block, h.block_count);
        let ready = st.progress.ready_layers();
        drop(st);
        self.stats.add(&self.stats.block_layers, u64::from(h.block_count));
        entry.phase.send_if_modified(|p| {
            let changed = p.ready_layers != ready;
            p.ready_layers = ready;
            changed
        });
        Step::Continue
    }

    /// Writes `payload`'s block-layers into `blocks`, in order.
    fn write_host(&self, blocks: &[BlockId], layer: u32, payload: &[u8]) -> Result<()> {
        let bl = self.layout.bytes_per_block_layer();
        payload.chunks_exact(bl).zip(blocks).try_for_each(|(bytes, &block)| self.sink.write_layer(block, layer, bytes))
    }

    /// Writes a payload that stayed in device memory: copied on the device where the sink
    /// can take it there, else brought to the host once and written as any other.
    fn write_device(&self, blocks: &[BlockId], layer: u32, payload: &DevicePayload) -> Result<()> {
        let bl = self.layout.bytes_per_block_layer();
        let blocks = &blocks[..payload.len() / bl];
        if self.sink.write_layers_device(blocks, layer, payload.bytes())? {
            return Ok(());
        }
        let host = payload.to_host().map_err(|detail| Error::Link { transport: "device memory", detail: format!("copying a payload to the host: {detail}") })?;
        self.write_host(blocks, layer, &host)
    }

    fn complete(&self, entry: &Entry) -> Step {
        let mut st = entry.lock();
        match st.status {
            Status::Open => {}
            Status::Ended(w) => return Step::Failed(w),
            Status::Completed | Status::Taken => {
                drop(st);
                return self.unexpected(entry, "second done");
            }
        }
        let missing = st.progress.missing();
        if missing > 0 {
            drop(st);
            return self.reject(
                entry,
                Error::Incomplete {
                    reservation: entry.id,
                    missing,
                },
            );
        }
        st.status = Status::Completed;
        drop(st);
        self.abort_timer(entry);
        self.stats.record_transfer(entry.created.elapsed());
        entry.phase.send_modify(|p| p.outcome = Some(Outcome::Completed));
        tracing::debug!(reservation = entry.id.0, "reservation completed");
        Step::Completed
    }
}
