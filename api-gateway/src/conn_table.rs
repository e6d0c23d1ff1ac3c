//! The table of a listener's open client connections: how many are open, in all and per
//! client address, which of them are idle, and which idle connection gives way when the
//! table is full.
//!
//! A connection is *idle* while no request of it is in progress: before its first
//! request's headers are complete (a half-open connection, a TLS handshake), and between
//! keep-alive requests. It is *busy* from the moment its request's headers are parsed
//! until its response body is done. When the table is full, a new connection takes the
//! place of the connection idle the longest, which is closed; a busy connection is never
//! closed for another. So connections that never send a request, from however many
//! addresses, cannot keep a real client out (issue #39: with the table full of them every
//! new connection was refused until their header timeouts); to push a real client's
//! connection out before its headers arrive, an attacker must open more connections than
//! the table holds in that time. Per address there is no eviction: one address past its
//! cap is refused, so one address cannot cycle everyone else's idle connections out any
//! faster than the global cap allows.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// One listener's open connections under its caps.
pub struct Table {
    max_connections: usize,
    max_per_address: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_address: HashMap<IpAddr, usize>,
    conns: HashMap<u64, Entry>,
    /// Idle connections by when they became idle (a sequence number): the first is the
    /// one to evict.
    idle: BTreeMap<u64, u64>,
    seq: u64,
}

struct Entry {
    address: IpAddr,
    /// Its key in `idle` while idle.
    idle_since: Option<u64>,
    evict: Arc<Notify>,
}

/// Why a connection was not admitted (the `reason` label of
/// `baton_gateway_connections_refused_total`).
pub type Refusal = &'static str;

impl Table {
    pub fn new(max_connections: usize, max_per_address: usize) -> Arc<Table> {
        Arc::new(Table { max_connections, max_per_address, inner: Mutex::new(Inner::default()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a connection from `address`, idle until its first request: its slot and
    /// whether an idle connection was evicted to make room. Refused when its address is
    /// at its cap, or when the table is full and every connection in it is busy.
    pub fn admit(self: &Arc<Self>, address: IpAddr) -> Result<(Slot, bool), Refusal> {
        let mut t = self.lock();
        if t.by_address.get(&address).copied().unwrap_or(0) >= self.max_per_address {
            return Err("max_per_address");
        }
        let mut evicted = false;
        if t.conns.len() >= self.max_connections {
            let Some((_, oldest)) = t.idle.pop_first() else { return Err("max_connections") };
            let entry = t.remove(oldest);
            entry.evict.notify_one();
            evicted = true;
        }
        t.seq += 1;
        let id = t.seq;
        t.idle.insert(id, id);
        *t.by_address.entry(address).or_default() += 1;
        let evict = Arc::new(Notify::new());
        t.conns.insert(id, Entry { address, idle_since: Some(id), evict: evict.clone() });
        crate::metrics::set_open_connections(t.conns.len());
        drop(t);
        let tracker = Tracker { table: self.clone(), id, busy: Arc::new(AtomicUsize::new(0)) };
        Ok((Slot { tracker, evict }, evicted))
    }

    /// Connections in the table now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().conns.len()
    }
}

impl Inner {
    fn remove(&mut self, id: u64) -> Entry {
        let entry = self.conns.remove(&id).expect("an idle connection is in the table");
        if let Some(since) = entry.idle_since {
            self.idle.remove(&since);
        }
        if let Some(n) = self.by_address.get_mut(&entry.address) {
            *n -= 1;
            if *n == 0 {
                self.by_address.remove(&entry.address);
            }
        }
        entry
    }
}

/// A connection's place in the table, given back when dropped (unless it was evicted:
/// then the place is already another connection's).
pub struct Slot {
    tracker: Tracker,
    evict: Arc<Notify>,
}

impl Slot {
    /// What the connection's requests mark busy with.
    pub fn tracker(&self) -> Tracker {
        self.tracker.clone()
    }

    /// Resolves when the connection was evicted: the caller closes it (gracefully if a
    /// request started since).
    pub async fn evicted(&self) {
        self.evict.notified().await
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut t = self.tracker.table.lock();
        if t.conns.contains_key(&self.tracker.id) {
            t.remove(self.tracker.id);
            crate::metrics::set_open_connections(t.conns.len());
        }
    }
}

/// Marks a connection's requests in progress.
#[derive(Clone)]
pub struct Tracker {
    table: Arc<Table>,
    id: u64,
    /// Requests in progress (kept here too, so that an evicted connection still knows).
    busy: Arc<AtomicUsize>,
}

impl Tracker {
    /// The connection is busy until the returned guard is dropped.
    pub fn busy(&self) -> Busy {
        if self.busy.fetch_add(1, Ordering::SeqCst) == 0 {
            let mut t = self.table.lock();
            if let Some(since) = t.conns.get_mut(&self.id).and_then(|e| e.idle_since.take()) {
                t.idle.remove(&since);
            }
        }
        Busy(self.clone())
    }

    /// Whether a request of the connection is in progress.
    pub fn is_busy(&self) -> bool {
        self.busy.load(Ordering::SeqCst) > 0
    }
}

/// A request in progress; the connection is idle again (and last in line for eviction)
/// when the last one is dropped.
pub struct Busy(Tracker);

impl Drop for Busy {
    fn drop(&mut self) {
        let tracker = &self.0;
        if tracker.busy.fetch_sub(1, Ordering::SeqCst) == 1 {
            let mut t = tracker.table.lock();
            t.seq += 1;
            let seq = t.seq;
            if let Some(e) = t.conns.get_mut(&tracker.id) {
                e.idle_since = Some(seq);
                t.idle.insert(seq, tracker.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
    }

    #[test]
    fn a_full_table_gives_the_longest_idle_place_to_a_new_connection() {
        let table = Table::new(3, 2);
        let (a, _) = table.admit(ip(2)).unwrap();
        let (b, _) = table.admit(ip(3)).unwrap();
        let (c, _) = table.admit(ip(4)).unwrap();
        // `a` is busy (its request in progress), so `b` is the oldest idle one.
        let busy = a.tracker().busy();
        let (d, evicted) = table.admit(ip(5)).unwrap();
        assert!(evicted);
        assert_eq!(table.len(), 3);
        let b_evicted = futures::FutureExt::now_or_never(b.evicted());
        assert!(b_evicted.is_some(), "the oldest idle connection is told to close");
        assert!(futures::FutureExt::now_or_never(c.evicted()).is_none());
        // `a` idle again: it becomes the newest idle one, so `c` goes next, then `d`, then `a`.
        drop(busy);
        let mut newer = Vec::new();
        for expected in [&c, &d, &a] {
            let (slot, evicted) = table.admit(ip(6 + newer.len() as u8)).unwrap_or_else(|r| panic!("{r}"));
            assert!(evicted);
            assert!(futures::FutureExt::now_or_never(expected.evicted()).is_some());
            newer.push(slot);
        }
        // Dropping evicted slots frees nothing twice.
        drop((a, b, c, d));
        assert_eq!(table.len(), 3);
    }

    #[test]
    fn busy_connections_are_never_evicted_and_addresses_keep_their_cap() {
        let table = Table::new(2, 1);
        let (a, _) = table.admit(ip(2)).unwrap();
        assert_eq!(table.admit(ip(2)).err(), Some("max_per_address"));
        let (b, _) = table.admit(ip(3)).unwrap();
        let (_ba, _bb) = (a.tracker().busy(), b.tracker().busy());
        assert_eq!(table.admit(ip(4)).err(), Some("max_connections"));
        assert!(a.tracker().is_busy());
        drop((_ba, _bb));
        assert!(!a.tracker().is_busy());
        drop(a);
        assert_eq!(table.len(), 1);
        let (_c, evicted) = table.admit(ip(2)).unwrap();
        assert!(!evicted, "a place was free");
        drop(b);
        assert_eq!(table.len(), 1);
    }
}
