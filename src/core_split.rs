//! How `baton up` divides the machine's cores between its two engines.
//!
//! Each CPU engine runs a fork-join pool whose workers spin between jobs, so two
//! engines that each take every core fight for them whenever both compute: a decode
//! step waits behind a prefill chunk on the same core and the stream stutters. The
//! split gives each engine its own share of `--threads` instead.
//!
//! Default: the prefill engine gets a quarter (at least one thread), the decode engine
//! the rest. In `baton up` the decode engine does most of the arithmetic: it decodes
//! every stream and also prefills every uncached tail shorter than
//! `--local-prefill-threshold` (a chat turn's new message and the last reply); the
//! prefill engine only sees long, cold tails. One core cannot be divided: both engines
//! then get one thread and share it.

use anyhow::{ensure, Result};

/// Compute threads of each engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoreSplit {
    pub decode: usize,
    pub prefill: usize,
}

impl CoreSplit {
    /// Both engines on all `threads` (benchmarks that run one engine at a time).
    pub fn shared(threads: usize) -> CoreSplit {
        CoreSplit {
            decode: threads.max(1),
            prefill: threads.max(1),
        }
    }

    /// Divides `total` threads; an explicit count wins, and the other engine gets
    /// what is left (at least one).
    pub fn divide(
        total: usize,
        decode: Option<usize>,
        prefill: Option<usize>,
    ) -> Result<CoreSplit> {
        ensure!(total >= 1, "--threads must be at least 1");
        ensure!(
            decode != Some(0) && prefill != Some(0),
            "--decode-threads and --prefill-threads must be at least 1"
        );
        let rest = |given: usize| total.saturating_sub(given).max(1);
        Ok(match (decode, prefill) {
            (Some(d), Some(p)) => CoreSplit {
                decode: d,
                prefill: p,
            },
            (Some(d), None) => CoreSplit {
                decode: d,
                prefill: rest(d),
            },
            (None, Some(p)) => CoreSplit {
                decode: rest(p),
                prefill: p,
            },
            (None, None) => {
                let prefill = (total / 4).max(1);
                CoreSplit {
                    decode: rest(prefill),
                    prefill,
                }
            }
        })
    }

    /// More threads than `total` in all: the engines will contend for cores.
    pub fn oversubscribes(&self, total: usize) -> bool {
        self.decode + self.prefill > total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(total: usize, d: Option<usize>, p: Option<usize>) -> (usize, usize) {
        let s = CoreSplit::divide(total, d, p).unwrap();
        (s.decode, s.prefill)
    }

    #[test]
    fn the_default_gives_prefill_a_quarter_and_decode_the_rest() {
        assert_eq!(split(2, None, None), (1, 1));
        assert_eq!(split(3, None, None), (2, 1));
        assert_eq!(split(4, None, None), (3, 1));
        assert_eq!(split(8, None, None), (6, 2));
        assert_eq!(split(16, None, None), (12, 4));
        assert_eq!(split(64, None, None), (48, 16));
        for total in 2..=256 {
            let s = CoreSplit::divide(total, None, None).unwrap();
            assert_eq!(s.decode + s.prefill, total, "{total}");
            assert!(s.prefill >= 1 && s.decode >= s.prefill, "{total}: {s:?}");
        }
    }

    #[test]
    fn one_core_cannot_be_divided() {
        let s = CoreSplit::divide(1, None, None).unwrap();
        assert_eq!((s.decode, s.prefill), (1, 1));
        assert!(s.oversubscribes(1));
    }

    #[test]
    fn explicit_counts_win_and_the_other_engine_gets_the_rest() {
        assert_eq!(split(8, Some(5), None), (5, 3));
        assert_eq!(split(8, None, Some(6)), (2, 6));
        assert_eq!(split(8, Some(8), None), (8, 1));
        assert_eq!(split(8, Some(3), Some(3)), (3, 3));
        assert!(CoreSplit::divide(8, Some(6), Some(6))
            .unwrap()
            .oversubscribes(8));
        assert!(CoreSplit::divide(8, Some(0), None).is_err());
        assert!(CoreSplit::divide(8, None, Some(0)).is_err());
        assert!(CoreSplit::divide(0, None, None).is_err());
    }
}
