//! Which block-layers of one reservation have been installed: the receiver's pure core.
//!
//! Owns: [`Progress`], a bitmap over (layer, block index) plus per-layer counts.
//! Invariants: a (layer, block) pair is admitted at most once and only inside the
//! reservation and at or after its layer's skip (see [`crate::Grant::skip`]); `ready_layers`
//! counts the complete layers from the first one without a gap; `missing() == 0` exactly
//! when every wanted pair was recorded.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::types::ReservationId;

#[derive(Clone, Debug)]
pub struct Progress {
    blocks: u32,
    layers: Range<u32>,
    /// Per layer of the range: leading blocks not wanted.
    skip: Vec<u32>,
    installed: Vec<u64>,
    per_layer: Vec<u32>,
    ready_layers: u32,
    missing: u64,
}

impl Progress {
    /// Progress over `blocks` blocks of `layers`, of which layer `layers.start + i` wants
    /// blocks `skip[i]..` only (a missing or larger entry: see [`Progress::skip_of`]).
    pub fn new(blocks: u32, layers: Range<u32>, skip: &[u32]) -> Self {
        let n_layers = layers.end.saturating_sub(layers.start);
        let bits = u64::from(blocks) * u64::from(n_layers);
        let skip: Vec<u32> = (0..n_layers as usize).map(|i| skip.get(i).copied().unwrap_or(0).min(blocks)).collect();
        let skipped: u64 = skip.iter().map(|&s| u64::from(s)).sum();
        let mut p = Progress {
            blocks,
            layers,
            per_layer: skip.clone(),
            skip,
            installed: vec![0; bits.div_ceil(64) as usize],
            ready_layers: 0,
            missing: bits - skipped,
        };
        p.advance_ready();
        p
    }

    /// Leading blocks layer `layer` (inside the range) does not want.
    fn skip_of(&self, layer: u32) -> u32 {
        self.skip[(layer - self.layers.start) as usize]
    }

    fn bit(&self, layer: u32, block: u32) -> usize {
        ((layer - self.layers.start) as usize) * self.blocks as usize + block as usize
    }

    /// Checks that `count` blocks of `layer` from block index `first` may be installed.
    pub fn admit(&self, reservation: ReservationId, layer: u32, first: u32, count: u32) -> Result<()> {
        if !self.layers.contains(&layer) {
            return Err(Error::OutOfRange {
                reservation,
                layer,
                block: first,
            });
        }
        if count == 0 {
            return Err(Error::FrameMalformed {
                what: "data frame with no blocks",
            });
        }
        let end = u64::from(first) + u64::from(count);
        if end > u64::from(self.blocks) {
            return Err(Error::OutOfRange {
                reservation,
                layer,
                block: first.max(self.blocks),
            });
        }
        if first < self.skip_of(layer) {
            // Before the layer's window: the receiver asked not to get it.
            return Err(Error::OutOfRange { reservation, layer, block: first });
        }
        for b in first..first + count {
            let i = self.bit(layer, b);
            if self.installed[i / 64] & (1 << (i % 64)) != 0 {
                return Err(Error::DuplicateBlock {
                    reservation,
                    layer,
                    block: b,
                });
            }
        }
        Ok(())
    }

    /// Records an admitted range as installed.
    pub fn record(&mut self, layer: u32, first: u32, count: u32) {
        for b in first..first + count {
            let i = self.bit(layer, b);
            self.installed[i / 64] |= 1 << (i % 64);
        }
        self.per_layer[(layer - self.layers.start) as usize] += count;
        self.missing -= u64::from(count);
        self.advance_ready();
    }

    fn advance_ready(&mut self) {
        while (self.ready_layers as usize) < self.per_layer.len()
            && self.per_layer[self.ready_layers as usize] == self.blocks
        {
            self.ready_layers += 1;
        }
    }

    /// Complete layers counted from the first layer of the range, without gaps.
    pub fn ready_layers(&self) -> u32 {
        self.ready_layers
    }

    /// Block-layers not yet installed.
    pub fn missing(&self) -> u64 {
        self.missing
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    proptest! {
        #[test]
        fn matches_a_set_model(
            blocks in 1u32..20,
            start in 0u32..3,
            n_layers in 1u32..5,
            frames in prop::collection::vec((0u32..9, 0u32..24, 0u32..6), 0..80),
            skips in prop::collection::vec(0u32..24, 0..5),
        ) {
            let layers = start..start + n_layers;
            let mut p = Progress::new(blocks, layers.clone(), &skips);
            let skip = |layer: u32| skips.get((layer - start) as usize).copied().unwrap_or(0).min(blocks);
            // The model: skipped pairs count as present from the start.
            let mut model: HashSet<(u32, u32)> =
                layers.clone().flat_map(|l| (0..skip(l)).map(move |b| (l, b))).collect();
            let skipped = model.len() as u64;
            for (layer, first, count) in frames {
                let ok = layers.contains(&layer)
                    && count > 0
                    && first + count <= blocks
                    && first >= skip(layer)
                    && (first..first + count).all(|b| !model.contains(&(layer, b)));
                let r = p.admit(ReservationId(1), layer, first, count);
                prop_assert_eq!(r.is_ok(), ok);
                if ok {
                    p.record(layer, first, count);
                    model.extend((first..first + count).map(|b| (layer, b)));
                }
                let total = u64::from(blocks) * u64::from(n_layers);
                prop_assert_eq!(p.missing(), total - model.len() as u64);
                prop_assert!(model.len() as u64 >= skipped);
                let ready = (0..n_layers)
                    .take_while(|l| (0..blocks).all(|b| model.contains(&(start + l, b))))
                    .count() as u32;
                prop_assert_eq!(p.ready_layers(), ready);
            }
        }
    }
}
