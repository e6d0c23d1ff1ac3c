//! Sampling: validated request parameters, a per-sequence seeded sampler over the
//! model's logits, and the stop-string matcher for the streamed text.
//!
//! Invariants:
//! - a [`Sampler`] owns its random state, so a seeded sequence draws the same tokens
//!   whatever else shares its batch (one uniform draw per non-greedy token, none for
//!   greedy ones);
//! - reported log-probabilities are the log-softmax of the raw logits (temperature 1):
//!   the distribution the model gave, independent of the sampling knobs;
//! - temperature, then top-k, then top-p are applied in that order (as HF and vLLM);
//!   every tie is broken towards the lower token ID, so results never depend on the
//!   order a sort or select happened to leave equal elements in;
//! - [`StopMatcher`] never emits any part of a stop string: it holds back a suffix of
//!   the text that could still become one.

use std::cmp::Ordering;
use std::ops::Deref;

use serde::{Deserialize, Serialize};

use crate::rng::{unit_f64, Xoshiro256};

/// Largest accepted temperature (as OpenAI).
pub const MAX_TEMPERATURE: f32 = 2.0;
/// Largest accepted `top_logprobs` (as OpenAI).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most stop strings per request; each costs a scan of the held-back text per chunk.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string in bytes; bounds the text [`StopMatcher`] holds back.
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// Most stop token IDs per request.
pub const MAX_STOP_TOKEN_IDS: usize = 256;
/// `max_tokens` when a request does not say; the scheduler still caps it by context.
pub const DEFAULT_MAX_TOKENS: usize = 256;

/// Sampling parameters as a request states them. Turn them into
/// [`ValidSamplingParams`] with [`SamplingParams::validate`] before use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature in `[0, 2]`; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 turns it off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose mass reaches `top_p`, in
    /// `(0, 1]`; 1 turns it off.
    pub top_p: f32,
    /// Seed of the sequence's generator; `None` seeds from the OS.
    pub seed: Option<u64>,
    /// Most tokens to generate, at least 1.
    pub max_tokens: usize,
    /// Token IDs that end the sequence (not emitted).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end the sequence (not emitted).
    pub stop_strings: Vec<String>,
    /// Report the sampled token's log-probability.
    pub logprobs: bool,
    /// Also report this many most likely alternatives, `0..=20` (needs `logprobs`).
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_tokens: DEFAULT_MAX_TOKENS,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

/// Errors of sampling: bad parameters (client errors) and bad logits (engine bugs).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SamplingError {
    /// A request parameter is out of range; `field` is its [`SamplingParams`] name.
    #[error("invalid sampling parameter `{field}`: {reason}")]
    InvalidParam {
        /// The parameter's name.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The model produced no logits.
    #[error("empty logits")]
    EmptyLogits,
    /// A logit is NaN or +infinity (-infinity is a valid mask).
    #[error("logit of token {index} is NaN or +infinity")]
    NonFiniteLogit {
        /// Its token ID.
        index: usize,
    },
    /// Every logit is -infinity: no token can be drawn.
    #[error("every logit is masked")]
    AllMasked,
    /// More logits than `u32` token IDs can name.
    #[error("{len} logits exceed the token ID range")]
    VocabTooLarge {
        /// Number of logits.
        len: usize,
    },
}

impl SamplingError {
    /// A stable, low-cardinality name for metrics labels and API error types.
    pub fn label(&self) -> &'static str {
        match self {
            Self::InvalidParam { .. } => "invalid_sampling_params",
            Self::EmptyLogits => "empty_logits",
            Self::NonFiniteLogit { .. } => "non_finite_logit",
            Self::AllMasked => "all_masked",
            Self::VocabTooLarge { .. } => "vocab_too_large",
        }
    }
}

fn invalid(field: &'static str, reason: &'static str) -> SamplingError {
    SamplingError::InvalidParam { field, reason }
}

impl SamplingParams {
    /// Checks every field, naming the first bad one.
    pub fn validate(self) -> Result<ValidSamplingParams, SamplingError> {
        // `!(a <= x)` rather than `x > a` so that NaN is rejected too.
        if !(0.0..=MAX_TEMPERATURE).contains(&self.temperature) {
            return Err(invalid("temperature", "must be in [0, 2]"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", "must be in (0, 1]"));
        }
        if self.max_tokens == 0 {
            return Err(invalid("max_tokens", "must be at least 1"));
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(invalid("top_logprobs", "must be at most 20"));
        }
        if self.top_logprobs > 0 && !self.logprobs {
            return Err(invalid("top_logprobs", "requires logprobs"));
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(invalid("stop_token_ids", "at most 256 IDs"));
        }
        if self.stop_strings.len() > MAX_STOP_STRINGS {
            return Err(invalid("stop_strings", "at most 16 stop strings"));
        }
        if self.stop_strings.iter().any(String::is_empty) {
            return Err(invalid("stop_strings", "must not contain an empty string"));
        }
        if self.stop_strings.iter().any(|s| s.len() > MAX_STOP_STRING_BYTES) {
            return Err(invalid("stop_strings", "each must be at most 256 bytes"));
        }
        Ok(ValidSamplingParams(self))
    }
}

/// Sampling parameters that passed [`SamplingParams::validate`]; read their fields
/// through `Deref`. The only way to build one is to validate.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidSamplingParams(SamplingParams);

impl Deref for ValidSamplingParams {
    type Target = SamplingParams;
    fn deref(&self) -> &SamplingParams {
        &self.0
    }
}

impl ValidSamplingParams {
    /// Whether every token is the argmax (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.0.temperature == 0.0 || self.0.top_k == 1
    }

    /// Whether `token` ends the sequence.
    pub fn is_stop_token(&self, token: u32) -> bool {
        self.0.stop_token_ids.contains(&token)
    }

    /// The parameters, unwrapped.
    pub fn into_inner(self) -> SamplingParams {
        self.0
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, statistically strong, and
/// fully specified, so a seed means the same stream on every platform and release.
#[derive(Debug, Clone)]
struct Rng(Xoshiro256);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(Xoshiro256::seed_from_u64(seed))
    }

    fn next_u64(&mut self) -> u64 {
        self.0.next_star_star()
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }
}

/// A seed for requests without one: OS randomness (through `RandomState`'s keys),
/// the clock and a counter, so two requests in the same nanosecond still differ.
fn os_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(nanos);
    h.write_u64(COUNTER.fetch_add(1, AtomicOrdering::Relaxed));
    h.finish()
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The token ID.
    pub token: u32,
    /// Its log-probability under the raw logits (temperature 1); 0 unless the
    /// request asked for `logprobs`, which costs an exp over the vocabulary.
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens with their log-probabilities, most
    /// likely first (empty unless requested).
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Most likely first, ties to the lower token ID: a total order, so selection and
/// sorting give the same result however equal elements started out.
fn desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The sampler of one sequence: its parameters, its generator and scratch space
/// reused across steps (a 49,152-token vocabulary would otherwise allocate per token).
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f32,
    top_k: usize,
    top_p: f32,
    /// Whether the request asked for log-probabilities (they cost an exp over the vocabulary).
    logprobs: bool,
    top_logprobs: usize,
    seed: u64,
    rng: Rng,
    cand: Vec<(f32, u32)>,
    weights: Vec<f32>,
    masses: Vec<f64>,
    chunk_sums: Vec<f64>,
}

impl Sampler {
    /// A sampler seeded from the request's seed, or from the OS without one.
    pub fn new(params: &ValidSamplingParams) -> Self {
        Self::with_seed(params, params.seed.unwrap_or_else(os_seed))
    }

    /// A sampler with an explicit seed (overrides the request's).
    pub fn with_seed(params: &ValidSamplingParams, seed: u64) -> Self {
        Self {
            temperature: params.temperature,
            top_k: if params.is_greedy() { 1 } else { params.top_k },
            top_p: params.top_p,
            logprobs: params.logprobs,
            top_logprobs: params.top_logprobs,
            seed,
            rng: Rng::new(seed),
            cand: Vec::new(),
            weights: Vec::new(),
            masses: Vec::new(),
            chunk_sums: Vec::new(),
        }
    }

    /// The seed in use (report it so a response can be reproduced).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Advances the generator as [`Sampler::sample`] would, without logits: for
    /// a token another sampler with the same seed drew (a remote prefill's
    /// first token), so the following draws match a sequence that drew it here.
    pub fn skip_draw(&mut self) {
        if self.top_k != 1 {
            self.rng.next_f64();
        }
    }

    /// Whether this sampler's draw is the argmax alone and it wants no log-probabilities:
    /// its token may then be picked where the logits are, by [`Sampler::sample`]'s rules
    /// (a greedy draw leaves the sampler's state as it was, so nothing else changes).
    pub fn is_plain_greedy(&self) -> bool {
        self.top_k == 1 && !self.logprobs
    }

    /// Draws the next token from `logits` (one per vocabulary entry; `-inf` masks a
    /// token). Fails on empty logits, NaN or `+inf`, or when everything is masked.
    pub fn sample(&mut self, logits: &[f32]) -> Result<Sampled, SamplingError> {
        if logits.is_empty() {
            return Err(SamplingError::EmptyLogits);
        }
        if u32::try_from(logits.len()).is_err() {
            return Err(SamplingError::VocabTooLarge { len: logits.len() });
        }
        let (max, argmax, live) = scan(logits)?;
        let (token, raw_sum) = if self.top_k == 1 {
            (argmax, None)
        } else {
            let inv_t = 1.0 / self.temperature;
            let sum = exp_into(&mut self.weights, logits, max, inv_t);
            let token = self.draw(logits, max, inv_t, live, sum);
            // At temperature 1 the weights before masking were the raw softmax's.
            (token, (inv_t == 1.0).then_some(sum))
        };
        if !self.logprobs {
            return Ok(Sampled { token: token as u32, logprob: 0.0, top_logprobs: Vec::new() });
        }
        let raw_sum = raw_sum.unwrap_or_else(|| exp_into(&mut self.weights, logits, max, 1.0));
        let lse = max + raw_sum.ln() as f32;
        let logprob = logits[token] - lse;
        let top_logprobs = self.top_logprobs(logits, lse, live);
        Ok(Sampled { token: token as u32, logprob, top_logprobs })
    }

    /// Samples from `self.weights` (the temperature-scaled softmax numerators) after
    /// top-k and top-p.
    fn draw(&mut self, logits: &[f32], max: f32, inv_t: f32, live: usize, total: f64) -> usize {
        if let Some(cut) = self.cut(logits, max, inv_t, live, total) {
            for (i, (w, &x)) in self.weights.iter_mut().zip(logits).enumerate() {
                if desc(&(x, i as u32), &cut) == Ordering::Greater {
                    *w = 0.0;
                }
            }
        }
        pick(&self.weights, self.rng.next_f64(), &mut self.chunk_sums)
    }

    /// The last token (in `desc` order) that top-k and top-p keep; `None` keeps all.
    /// `total` is the sum of all weights.
    fn cut(&mut self, logits: &[f32], max: f32, inv_t: f32, live: usize, total: f64) -> Option<(f32, u32)> {
        let top_p = self.top_p < 1.0;
        let p = f64::from(self.top_p);
        if self.top_k > 0 && self.top_k < live {
            top_k_into(&mut self.cand, logits, self.top_k);
            if !top_p {
                return self.cand.last().copied();
            }
            // Top-p renormalizes over what top-k kept.
            let kept = mass(&self.cand, &self.weights);
            return walk(&self.cand, &self.weights, p * kept, 0.0);
        }
        if !top_p {
            return None;
        }
        let threshold = p * total;
        // Model distributions put top-p's mass in a few dozen tokens: try growing
        // heads first, cheap as top-k, before the general bucket search.
        let mut k = 64;
        while k < live && k <= 512 {
            top_k_into(&mut self.cand, logits, k);
            if mass(&self.cand, &self.weights) >= threshold {
                return walk(&self.cand, &self.weights, threshold, 0.0);
            }
            k *= 8;
        }
        let before = self.top_p_boundary(logits, max, inv_t, threshold);
        walk(&self.cand, &self.weights, threshold, before)
    }

    /// Finds the bucket of scaled logits where the cumulative mass crosses
    /// `threshold`, leaves its tokens, sorted, in `cand` and returns the mass of all
    /// more likely buckets.
    ///
    /// Tokens are bucketed by `(max - x) / T` (monotone in the logit): one pass sums
    /// the weights per bucket, and only the bucket holding the cut is gathered and
    /// sorted. Typical distributions cost a few linear passes; only a near-flat one
    /// (a huge boundary bucket) pays for a sort.
    fn top_p_boundary(&mut self, logits: &[f32], max: f32, inv_t: f32, threshold: f64) -> f64 {
        let bucket = |x: f32| (((max - x) * inv_t * BUCKETS_PER_UNIT) as usize).min(BUCKETS - 1);
        let masses = &mut self.masses;
        masses.clear();
        masses.resize(BUCKETS, 0.0);
        // Tokens of weight 0 (masked, or underflowed) can never be drawn: skip them.
        for (&x, &w) in logits.iter().zip(&self.weights) {
            if w > 0.0 {
                masses[bucket(x)] += f64::from(w);
            }
        }
        let mut acc = 0.0;
        let mut boundary = BUCKETS - 1;
        for (b, &m) in masses.iter().enumerate() {
            if acc + m >= threshold {
                boundary = b;
                break;
            }
            acc += m;
        }
        let w = &self.weights;
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .zip(w)
                .enumerate()
                .filter(|&(_, (&x, &wi))| wi > 0.0 && bucket(x) == boundary)
                .map(|(i, (&x, _))| (x, i as u32)),
        );
        self.cand.sort_unstable_by(desc);
        acc
    }

    fn top_logprobs(&mut self, logits: &[f32], lse: f32, live: usize) -> Vec<(u32, f32)> {
        let n = self.top_logprobs.min(live);
        if n == 0 {
            return Vec::new();
        }
        if n < live {
            top_k_into(&mut self.cand, logits, n);
        } else {
            self.cand.clear();
            let live_tokens = logits.iter().enumerate().filter(|&(_, &x)| x > f32::NEG_INFINITY);
            self.cand.extend(live_tokens.map(|(i, &x)| (x, i as u32)));
            self.cand.sort_unstable_by(desc);
        }
        self.cand.iter().map(|&(x, i)| (i, x - lse)).collect()
    }
}

/// Scaled-logit buckets per unit of `(max - x) / T` for the top-k/top-p search.
const BUCKETS_PER_UNIT: f32 = 16.0;
/// Buckets in all; the last also holds everything further out.
const BUCKETS: usize = 2048;
/// Weights are summed in chunks of this many tokens, so `pick` can skip ahead.
const PICK_CHUNK: usize = 256;

/// `exp(x)` for `x <= 0` in plain f32 arithmetic (Cephes' `expf` polynomial, about
/// 1e-7 relative error): unlike libm it vectorizes, and it gives the same bits on every
/// platform, so a seeded sequence samples the same tokens everywhere. Returns exactly
/// 0 below -87 (f32 underflow) and for `-inf` (masked tokens).
#[inline]
fn exp_approx(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.0, 88.0);
    let shifted = xc * LOG2E + MAGIC;
    let k = shifted - MAGIC;
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // `shifted`'s low mantissa bits hold k (two's complement, offset by MAGIC's
    // bits): building 2^k from them avoids a float-to-int conversion, which halves
    // the cost. |k| <= 127 after the clamp keeps the exponent in 1..=254.
    let k_bits = shifted.to_bits().wrapping_sub(MAGIC.to_bits());
    let scale = f32::from_bits(k_bits.wrapping_add(127) << 23);
    if x < -87.0 {
        0.0
    } else {
        y * scale
    }
}

/// Sum in f64 over eight fixed lanes: vectorizes, and is deterministic.
fn sum_lanes(values: &[f32]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += f64::from(v);
        }
    }
    for (l, &v) in lanes.iter_mut().zip(rest) {
        *l += f64::from(v);
    }
    lanes.iter().sum()
}

/// Total weight of candidates.
fn mass(cand: &[(f32, u32)], weights: &[f32]) -> f64 {
    cand.iter().map(|&(_, i)| f64::from(weights[i as usize])).sum()
}

/// The first candidate (sorted, most likely first) at which the running mass from
/// `acc` reaches `threshold`; the last one if rounding leaves it just out of reach.
fn walk(cand: &[(f32, u32)], weights: &[f32], threshold: f64, mut acc: f64) -> Option<(f32, u32)> {
    for &c in cand {
        acc += f64::from(weights[c.1 as usize]);
        if acc >= threshold {
            return Some(c);
        }
    }
    cand.last().copied()
}

/// Validity, maximum and live (not `-inf`) count in one vectorizable pass, then the
/// first index of the maximum (ties go to the lowest ID).
fn scan(logits: &[f32]) -> Result<(f32, usize, usize), SamplingError> {
    let mut maxes = [f32::NEG_INFINITY; 8];
    let mut bad = [false; 8];
    let mut live = [0usize; 8];
    let mut lane = |j: usize, x: f32| {
        maxes[j] = if x > maxes[j] { x } else { maxes[j] };
        bad[j] |= x.is_nan() | (x == f32::INFINITY);
        live[j] += usize::from(x > f32::NEG_INFINITY);
    };
    let chunks = logits.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (j, &x) in c.iter().enumerate() {
            lane(j, x);
        }
    }
    for (j, &x) in rest.iter().enumerate() {
        lane(j, x);
    }
    if bad.iter().any(|&b| b) {
        let index = logits.iter().position(|&x| x.is_nan() || x == f32::INFINITY).unwrap_or(0);
        return Err(SamplingError::NonFiniteLogit { index });
    }
    let max = maxes.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    let live: usize = live.iter().sum();
    if live == 0 {
        return Err(SamplingError::AllMasked);
    }
    let argmax = logits.iter().position(|&x| x == max).unwrap_or(0);
    Ok((max, argmax, live))
}

/// Fills `out` with `exp((x - max) * scale)` and returns its sum. Two simple loops
/// rather than one fused one: both vectorize.
fn exp_into(out: &mut Vec<f32>, logits: &[f32], max: f32, scale: f32) -> f64 {
    out.clear();
    out.resize(logits.len(), 0.0);
    for (o, &x) in out.iter_mut().zip(logits) {
        *o = exp_approx((x - max) * scale);
    }
    sum_lanes(out)
}

/// The `k` most likely tokens (`0 < k < live`), sorted most likely first, into
/// `cand`. A streaming filter: tokens below the current k-th best are skipped with
/// one comparison, and the buffer is cut back to `k` whenever it doubles.
fn top_k_into(cand: &mut Vec<(f32, u32)>, logits: &[f32], k: usize) {
    cand.clear();
    let cap = (2 * k).max(256);
    let mut floor = f32::NEG_INFINITY;
    for (i, &x) in logits.iter().enumerate() {
        // A later token equal to the floor loses the tie (higher ID): `>` suffices.
        if x > floor {
            cand.push((x, i as u32));
            if cand.len() >= cap {
                cand.select_nth_unstable_by(k - 1, desc);
                cand.truncate(k);
                floor = cand[k - 1].0;
            }
        }
    }
    if cand.len() > k {
        cand.select_nth_unstable_by(k - 1, desc);
        cand.truncate(k);
    }
    cand.sort_unstable_by(desc);
}

/// Draws an index with probability proportional to `weights` (not all zero), from
/// the uniform `u` in `[0, 1)`: chunk sums first, then a walk inside one chunk.
fn pick(weights: &[f32], u: f64, chunk_sums: &mut Vec<f64>) -> usize {
    chunk_sums.clear();
    chunk_sums.extend(weights.chunks(PICK_CHUNK).map(sum_lanes));
    let target = u * chunk_sums.iter().sum::<f64>();
    let (mut acc, mut chunk, mut before) = (0.0, 0, 0.0);
    for (c, &s) in chunk_sums.iter().enumerate() {
        if s > 0.0 {
            (chunk, before) = (c, acc);
            if acc + s > target {
                break;
            }
            acc += s;
        }
    }
    let mut acc = before;
    // Inside the chunk; if rounding leaves the target out of reach, the chunk's last
    // token with weight.
    let base = chunk * PICK_CHUNK;
    let mut last = base;
    for (j, &w) in weights[base..].iter().take(PICK_CHUNK).enumerate() {
        if w > 0.0 {
            acc += f64::from(w);
            last = base + j;
            if acc > target {
                break;
            }
        }
    }
    last
}

/// What [`StopMatcher::push`] lets through.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopCheck {
    /// Text safe to emit now.
    pub text: String,
    /// A stop string completed: emit `text`, then end the sequence.
    pub stopped: bool,
}

/// Finds stop strings in streamed text. Fed decoded chunks, it emits all text except
/// a held-back suffix that is a prefix of some stop string; once a stop string
/// completes, it emits the text before it and stops (the stop string is never
/// emitted, nor anything after it).
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    longest: usize,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        Self { stops, longest, held: String::new(), stopped: false }
    }

    /// Whether a stop string has completed.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds the next decoded chunk.
    pub fn push(&mut self, chunk: &str) -> StopCheck {
        if self.stopped {
            return StopCheck { text: String::new(), stopped: true };
        }
        self.held.push_str(chunk);
        // The earliest completed stop string wins; everything before it is emitted.
        // A match can only lie inside `held`: text that could start one is never
        // released (see below).
        if let Some(pos) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.held.truncate(pos);
            self.stopped = true;
            return StopCheck { text: std::mem::take(&mut self.held), stopped: true };
        }
        // Hold back from the earliest position whose suffix could still grow into a
        // stop string; only the last `longest - 1` bytes can.
        let min_start = self.held.len().saturating_sub(self.longest.saturating_sub(1));
        let hold = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= min_start)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let rest = self.held.split_off(hold);
        StopCheck { text: std::mem::replace(&mut self.held, rest), stopped: false }
    }

    /// Ends the stream without a stop string: returns the held-back text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests;
