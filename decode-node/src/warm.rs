//! Which conversations this node holds warm, and the tokens of each one's
//! latest turn (prompt plus reply), so a drain can hand every conversation to
//! its new owner: the engine's prefix cache is keyed by block hashes and
//! cannot give the tokens back.
//!
//! The table is bounded twice: past `capacity` conversations, or past
//! `max_tokens` tokens in all (the launcher sizes it from the KV memory: the
//! table cannot usefully remember more than the cache can hold), the least
//! recently used conversation is forgotten (its next turn after a drain then
//! starts cold, which is also what the engine's own LRU would have done to its
//! blocks). Entries are hints: the drain asks the engine what is still cached
//! before moving.

use std::collections::HashMap;
use std::sync::Mutex;

use baton_engine::kv::{ConversationId, OwnerId};

/// One warm conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WarmConversation {
    pub conversation: ConversationId,
    pub owner: OwnerId,
    pub platform_prefix_len: usize,
    /// The latest turn's prompt followed by its reply.
    pub tokens: Vec<u32>,
}

impl WarmConversation {
    /// A turn's prompt as its conversation's warm tokens; `None` without a conversation.
    pub fn of(req: &baton_engine::Request) -> Option<Self> {
        let conversation = req.conversation.clone()?;
        Some(WarmConversation { conversation, owner: req.owner.clone(), platform_prefix_len: req.platform_prefix_len, tokens: req.prompt.clone() })
    }
}

struct Entry {
    warm: WarmConversation,
    stamp: u64,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<ConversationId, Entry>,
    clock: u64,
    /// Tokens held by all entries.
    tokens: usize,
}

/// The bounded table of warm conversations.
pub struct WarmTable {
    inner: Mutex<Inner>,
    capacity: usize,
    max_tokens: usize,
}

impl WarmTable {
    pub fn new(capacity: usize, max_tokens: usize) -> Self {
        WarmTable { inner: Mutex::default(), capacity: capacity.max(1), max_tokens: max_tokens.max(1) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a finished turn: its tokens replace the conversation's previous ones.
    pub fn record(&self, warm: WarmConversation) {
        let mut g = self.lock();
        g.clock += 1;
        let stamp = g.clock;
        g.tokens += warm.tokens.len();
        if let Some(old) = g.entries.insert(warm.conversation.clone(), Entry { warm, stamp }) {
            g.tokens -= old.warm.tokens.len();
        }
        // O(n) over a bounded map, once per eviction; the newest entry stays
        // even when it alone is over the token bound.
        while g.entries.len() > 1 && (g.entries.len() > self.capacity || g.tokens > self.max_tokens) {
            let Some(oldest) = g.entries.iter().min_by_key(|(_, e)| e.stamp).map(|(k, _)| k.clone()) else {
                break;
            };
            if let Some(e) = g.entries.remove(&oldest) {
                g.tokens -= e.warm.tokens.len();
            }
        }
    }

    /// Whether the table remembers `conversation` (this node served its latest turn).
    pub fn contains(&self, conversation: &ConversationId) -> bool {
        self.lock().entries.contains_key(conversation)
    }

    /// How many leading tokens of `prompt` the conversation's latest turn here had (0 when
    /// the table does not remember it): what this node's cache would hold of `prompt` had
    /// nothing been evicted.
    pub fn shared_prefix(&self, conversation: &ConversationId, prompt: &[u32]) -> usize {
        let g = self.lock();
        g.entries.get(conversation).map_or(0, |e| e.warm.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count())
    }

    /// Forgets a conversation (it was evicted).
    pub fn remove(&self, conversation: &ConversationId) {
        let mut g = self.lock();
        if let Some(e) = g.entries.remove(conversation) {
            g.tokens -= e.warm.tokens.len();
        }
    }

    /// Every warm conversation, most recently used first (the ones most
    /// likely to have a next turn move first).
    pub fn most_recent_first(&self) -> Vec<WarmConversation> {
        let g = self.lock();
        let mut all: Vec<&Entry> = g.entries.values().collect();
        all.sort_by_key(|e| std::cmp::Reverse(e.stamp));
        all.into_iter().map(|e| e.warm.clone()).collect()
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warm(c: &str, tokens: &[u32]) -> WarmConversation {
        WarmConversation {
            conversation: ConversationId::parse(c).unwrap(),
            owner: OwnerId::parse("u").unwrap(),
            platform_prefix_len: 0,
            tokens: tokens.to_vec(),
        }
    }

    #[test]
    fn latest_turn_wins_and_order_is_most_recent_first() {
        let t = WarmTable::new(8, 1000);
        t.record(warm("a", &[1]));
        t.record(warm("b", &[2]));
        t.record(warm("a", &[1, 3, 4]));
        let all = t.most_recent_first();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0], warm("a", &[1, 3, 4]));
        assert_eq!(all[1], warm("b", &[2]));
    }

    #[test]
    fn bounded_by_capacity_forgetting_the_least_recent() {
        let t = WarmTable::new(2, 1000);
        t.record(warm("a", &[1]));
        t.record(warm("b", &[2]));
        t.record(warm("a", &[1, 5]));
        t.record(warm("c", &[3]));
        let names: Vec<String> = t.most_recent_first().iter().map(|w| w.conversation.as_str().to_string()).collect();
        assert_eq!(names, vec!["c", "a"]);
    }

    #[test]
    fn bounded_by_tokens_keeping_the_newest() {
        let t = WarmTable::new(100, 10);
        t.record(warm("a", &[1, 2, 3, 4]));
        t.record(warm("b", &[1, 2, 3, 4]));
        t.record(warm("c", &[1, 2, 3, 4]));
        let names: Vec<String> = t.most_recent_first().iter().map(|w| w.conversation.as_str().to_string()).collect();
        assert_eq!(names, vec!["c", "b"], "12 tokens > 10: the oldest goes");
        t.record(warm("d", &[0; 50]));
        assert_eq!(t.len(), 1, "an entry over the bound alone is kept, the rest go");
        t.remove(&ConversationId::parse("d").unwrap());
        t.record(warm("e", &[1; 10]));
        assert_eq!(t.len(), 1, "token count went back to zero on removal");
    }

    #[test]
    fn eviction_forgets() {
        let t = WarmTable::new(4, 1000);
        t.record(warm("a", &[1]));
        assert!(t.contains(&ConversationId::parse("a").unwrap()));
        assert_eq!(t.shared_prefix(&ConversationId::parse("a").unwrap(), &[1, 2]), 1);
        assert_eq!(t.shared_prefix(&ConversationId::parse("b").unwrap(), &[1, 2]), 0);
        t.remove(&ConversationId::parse("a").unwrap());
        assert!(t.is_empty());
        assert!(!t.contains(&ConversationId::parse("a").unwrap()));
    }
}
