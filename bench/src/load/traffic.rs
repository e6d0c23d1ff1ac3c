//! The shape of the chat traffic the load generator offers, after the seed's workload:
//! every conversation starts from the same system prompt, each turn resends the whole
//! history plus a new user message, replies are capped, a user thinks for an
//! exponentially distributed time between turns, and now and then pastes a long document.
//!
//! Pure and deterministic: the same seed gives the same messages and think times, so two
//! servers (Baton and llama-server) see exactly the same traffic.

use std::time::Duration;

use crate::rng::Xoshiro256pp;

/// Words the synthetic messages are made of: common English words, so a BPE tokenizer
/// spends about one to two tokens on each, as on real chat text.
const WORDS: &[&str] = &[
    "the", "system", "answer", "question", "please", "explain", "how", "why", "what", "when",
    "data", "model", "memory", "cache", "token", "prompt", "reply", "user", "server", "request",
    "time", "first", "second", "small", "large", "fast", "slow", "simple", "detail", "example",
    "write", "read", "code", "function", "value", "number", "list", "table", "file", "page",
    "cluster", "node", "batch", "queue", "latency", "budget", "price", "plan", "summary", "story",
    "about", "with", "from", "into", "over", "under", "again", "still", "only", "also",
    "good", "better", "best", "clear", "short", "long", "new", "old", "next", "last",
    "city", "river", "garden", "kitchen", "recipe", "travel", "weather", "music", "book", "film",
];

/// Parameters of the synthetic workload, scaled down from the seed's to one machine.
#[derive(Clone, Debug)]
pub struct TrafficShape {
    /// Words of the system prompt shared by every conversation.
    pub system_words: usize,
    /// Words of an ordinary user message.
    pub message_words: usize,
    /// Probability that a user message is a pasted document instead.
    pub long_doc_probability: f64,
    /// Words of a pasted document.
    pub long_doc_words: usize,
    /// Turns each conversation makes.
    pub turns: usize,
    /// Mean think time between a conversation's turns (exponential).
    pub think_time: Duration,
    pub seed: u64,
}

/// Deterministic generator of messages and think times for one conversation.
pub struct ConversationScript {
    rng: Xoshiro256pp,
    shape: TrafficShape,
}

impl ConversationScript {
    /// The script of conversation `index`: a stream independent of every other one.
    pub fn new(shape: &TrafficShape, index: u64) -> Self {
        let seed = shape.seed ^ crate::rng::mix64(index.wrapping_add(1));
        ConversationScript { rng: Xoshiro256pp::seed_from_u64(seed), shape: shape.clone() }
    }

    /// The next user message.
    pub fn next_message(&mut self) -> String {
        let long = self.rng.next_f64() < self.shape.long_doc_probability;
        let words = if long { self.shape.long_doc_words } else { self.shape.message_words };
        let mut text = if long { String::from("Please summarize this document: ") } else { String::new() };
        text.push_str(&words_from(&mut self.rng, words));
        text.push('?');
        text
    }

    /// Think time before the next turn: exponential with the configured mean, capped
    /// at ten means so one unlucky draw cannot stall a short run.
    pub fn think_time(&mut self) -> Duration {
        let mean = self.shape.think_time.as_secs_f64();
        if mean <= 0.0 {
            return Duration::ZERO;
        }
        let u = self.rng.next_f64();
        let draw = -mean * (1.0 - u).ln();
        Duration::from_secs_f64(draw.min(10.0 * mean))
    }
}

/// The shared system prompt of a run.
pub fn system_prompt(shape: &TrafficShape) -> String {
    let mut rng = Xoshiro256pp::seed_from_u64(shape.seed);
    format!("You are a helpful assistant. {}.", words_from(&mut rng, shape.system_words))
}

fn words_from(rng: &mut Xoshiro256pp, n: usize) -> String {
    let mut out = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> TrafficShape {
        TrafficShape {
            system_words: 50,
            message_words: 10,
            long_doc_probability: 0.1,
            long_doc_words: 200,
            turns: 4,
            think_time: Duration::from_millis(500),
            seed: 7,
        }
    }

    #[test]
    fn scripts_are_deterministic_and_distinct() {
        let s = shape();
        let a: Vec<String> = (0..5).map({
            let mut c = ConversationScript::new(&s, 3);
            move |_| c.next_message()
        }).collect();
        let b: Vec<String> = (0..5).map({
            let mut c = ConversationScript::new(&s, 3);
            move |_| c.next_message()
        }).collect();
        let other = ConversationScript::new(&s, 4).next_message();
        assert_eq!(a, b);
        assert_ne!(a[0], other);
        assert_eq!(system_prompt(&s), system_prompt(&s));
    }

    #[test]
    fn long_documents_and_think_times_follow_the_shape() {
        let s = shape();
        let mut c = ConversationScript::new(&s, 0);
        let n = 4000;
        let long = (0..n).filter(|_| c.next_message().starts_with("Please summarize")).count();
        let share = long as f64 / n as f64;
        assert!((share - 0.1).abs() < 0.02, "long share {share}");
        let mean = (0..n).map(|_| c.think_time().as_secs_f64()).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.05, "think mean {mean}");
    }
}
