//! [`Admission`]: one lock per conversation. Turns of one conversation see each other's
//! admission (a retried turn ID attaches, a second turn while one streams is a 409, a
//! delete waits for the turn it stops); turns of different conversations never wait on
//! each other, so one user's slow admission (a summary being generated, a slow store
//! write) cannot stall anyone else's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

type Lock = tokio::sync::Mutex<()>;

#[derive(Default)]
struct Table {
    /// A conversation's lock lives while a guard or a waiter holds it.
    locks: HashMap<String, Weak<Lock>>,
    /// Dead entries are swept when the table reaches this size (then twice the live size).
    sweep_at: usize,
}

/// The gateway's admission locks, by conversation ID.
#[derive(Default)]
pub struct Admission {
    table: Mutex<Table>,
}

/// Held while a conversation's admission decision is being made.
pub type AdmissionGuard = tokio::sync::OwnedMutexGuard<()>;

impl Admission {
    /// Waits for `conversation`'s lock.
    pub async fn lock(&self, conversation: &str) -> AdmissionGuard {
        let lock = {
            let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
            if t.locks.len() >= t.sweep_at.max(1024) {
                t.locks.retain(|_, w| w.strong_count() > 0);
                t.sweep_at = 2 * t.locks.len();
            }
            match t.locks.get(conversation).and_then(Weak::upgrade) {
                Some(l) => l,
                None => {
                    let l = Arc::new(Lock::new(()));
                    t.locks.insert(conversation.to_string(), Arc::downgrade(&l));
                    l
                }
            }
        };
        lock.lock_owned().await
    }

    /// Conversations whose lock is held or awaited now.
    pub fn busy(&self) -> usize {
        let t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        t.locks.values().filter(|w| w.strong_count() > 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn one_conversation_waits_for_itself_and_never_for_another() {
        let a = Admission::default();
        let held = a.lock("alice-conv").await;
        // Another conversation is admitted at once while alice's is held.
        tokio::time::timeout(Duration::from_millis(50), a.lock("bob-conv")).await.expect("bob does not wait for alice");
        // Alice's second turn waits until her first admission is done.
        assert!(tokio::time::timeout(Duration::from_millis(50), a.lock("alice-conv")).await.is_err());
        drop(held);
        tokio::time::timeout(Duration::from_millis(50), a.lock("alice-conv")).await.expect("free again");
    }

    #[tokio::test]
    async fn locks_of_finished_conversations_are_swept() {
        let a = Admission::default();
        for i in 0..5000 {
            drop(a.lock(&format!("c{i}")).await);
        }
        let kept = a.table.lock().unwrap().locks.len();
        assert!(kept <= 1024, "{kept} entries kept for 5,000 finished admissions");
        assert_eq!(a.busy(), 0);
    }
}
