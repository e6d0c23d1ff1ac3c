//! Who published each cached hash, so that deleting a conversation or a user deletes
//! exactly their blocks from the prefix index and the second tier.
//!
//! A "group" is one (user, conversation) pair; it lists the hashes it published and
//! disappears when it has none left, so a long-running node does not accumulate an
//! entry per conversation it ever saw.
//!
//! Invariants:
//! - a hash has at most one group (the first publisher keeps it: a later duplicate of
//!   the same user's prefix is the same data);
//! - `of_hash[h] == g` iff `groups[g].hashes` contains `h`;
//! - every live group is reachable from `by_user` and from `by_conversation` (when it
//!   has a conversation), and no empty group is live;
//! - platform blocks have no group: deleting users never touches the system prompt.

use std::collections::{HashMap, HashSet};

use super::ids::{BlockHash, BlockOwner, ConversationId, OwnerId};

#[derive(Debug)]
struct Group {
    user: OwnerId,
    conversation: Option<ConversationId>,
    hashes: HashSet<BlockHash>,
}

#[derive(Debug, Default)]
pub(crate) struct Owners {
    groups: Vec<Option<Group>>,
    free_ids: Vec<u32>,
    by_user: HashMap<OwnerId, HashMap<Option<ConversationId>, u32>>,
    by_conversation: HashMap<ConversationId, Vec<u32>>,
    of_hash: HashMap<BlockHash, u32>,
}

impl Owners {
    /// Records `owner` as the publisher of `hash`, unless it already has one.
    pub(crate) fn record(&mut self, hash: BlockHash, owner: &BlockOwner) {
        let BlockOwner::User { owner: user, conversation } = owner else {
            return;
        };
        if self.of_hash.contains_key(&hash) {
            return;
        }
        let existing = self.by_user.get(user).and_then(|m| m.get(conversation)).copied();
        let id = match existing {
            Some(id) => id,
            None => self.new_group(user, conversation),
        };
        if let Some(Some(g)) = self.groups.get_mut(id as usize) {
            g.hashes.insert(hash);
            self.of_hash.insert(hash, id);
        }
    }

    fn new_group(&mut self, user: &OwnerId, conversation: &Option<ConversationId>) -> u32 {
        let group = Group {
            user: user.clone(),
            conversation: conversation.clone(),
            hashes: HashSet::new(),
        };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.groups[id as usize] = Some(group);
                id
            }
            None => {
                // More than 2^32 live groups would need more than 2^32 cached blocks,
                // which the pool's u32 block IDs already rule out.
                let id = self.groups.len() as u32;
                self.groups.push(Some(group));
                id
            }
        };
        self.by_user
            .entry(user.clone())
            .or_default()
            .insert(conversation.clone(), id);
        if let Some(c) = conversation {
            self.by_conversation.entry(c.clone()).or_default().push(id);
        }
        id
    }

    /// Forgets the publisher of a hash that left both the index and the second tier.
    pub(crate) fn forget(&mut self, hash: BlockHash) {
        let Some(id) = self.of_hash.remove(&hash) else {
            return;
        };
        let empty = match self.groups.get_mut(id as usize) {
            Some(Some(g)) => {
                g.hashes.remove(&hash);
                g.hashes.is_empty()
            }
            _ => false,
        };
        if empty {
            self.remove_group(id);
        }
    }

    /// Unlinks a group everywhere and returns its hashes (already removed from
    /// `of_hash`).
    fn remove_group(&mut self, id: u32) -> HashSet<BlockHash> {
        let Some(group) = self.groups.get_mut(id as usize).and_then(Option::take) else {
            return HashSet::new();
        };
        self.free_ids.push(id);
        if let Some(m) = self.by_user.get_mut(&group.user) {
            m.remove(&group.conversation);
            if m.is_empty() {
                self.by_user.remove(&group.user);
            }
        }
        if let Some(c) = &group.conversation {
            if let Some(ids) = self.by_conversation.get_mut(c) {
                ids.retain(|&g| g != id);
                if ids.is_empty() {
                    self.by_conversation.remove(c);
                }
            }
        }
        for h in &group.hashes {
            self.of_hash.remove(h);
        }
        group.hashes
    }

    /// Removes every group of a conversation (of any user) and returns their hashes.
    pub(crate) fn take_conversation(&mut self, conversation: &ConversationId) -> Vec<BlockHash> {
        let ids = self.by_conversation.get(conversation).cloned().unwrap_or_default();
        let mut out = Vec::new();
        for id in ids {
            out.extend(self.remove_group(id));
        }
        out
    }

    /// Removes every group of a user and returns their hashes.
    pub(crate) fn take_user(&mut self, user: &OwnerId) -> Vec<BlockHash> {
        let ids: Vec<u32> = self
            .by_user
            .get(user)
            .map(|m| m.values().copied().collect())
            .unwrap_or_default();
        let mut out = Vec::new();
        for id in ids {
            out.extend(self.remove_group(id));
        }
        out
    }

    /// Number of live groups (for stats and leak tests).
    pub(crate) fn group_count(&self) -> usize {
        self.groups.len() - self.free_ids.len()
    }

    /// Every hash with a recorded publisher (tests only).
    #[cfg(test)]
    pub(crate) fn hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.of_hash.keys().copied()
    }

    #[cfg(test)]
    pub(crate) fn assert_consistent(&self) {
        let mut live = 0;
        for (id, g) in self.groups.iter().enumerate() {
            let Some(g) = g else { continue };
            live += 1;
            assert!(!g.hashes.is_empty(), "empty group {id} is live");
            for h in &g.hashes {
                assert_eq!(self.of_hash.get(h), Some(&(id as u32)));
            }
            assert_eq!(self.by_user.get(&g.user).and_then(|m| m.get(&g.conversation)), Some(&(id as u32)));
            if let Some(c) = &g.conversation {
                assert!(self.by_conversation.get(c).is_some_and(|ids| ids.contains(&(id as u32))));
            }
        }
        assert_eq!(live, self.group_count());
        let total: usize = self.groups.iter().flatten().map(|g| g.hashes.len()).sum();
        assert_eq!(total, self.of_hash.len());
        assert_eq!(self.by_user.values().map(HashMap::len).sum::<usize>(), live);
    }
}
