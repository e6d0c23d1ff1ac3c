//! Leader election for `baton plan` through etcd (`--leader-election --election-etcd
//! URL`): the etcd the coordinators already keep membership in, for deployments outside
//! Kubernetes or where the planner should not write Leases.
//!
//! One key, `/baton/planner/leader`, held under an etcd lease of this replica whose TTL
//! is a few intervals. Every interval a replica renews its lease (one keep-alive) and
//! then, in one transaction, creates the key if no one holds it, or reads who does. It
//! leads exactly when the key names its own lease: etcd serializes the transactions, so of
//! two replicas racing for a free key one creates it and the other reads it, and a holder
//! that stops renewing loses the key with its lease, after the TTL, to the next replica
//! that asks. A replica that cannot reach etcd, or whose lease expired, does not lead.
//! Leaving (`resign`) revokes the lease, which frees the key at once.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp, TxnOpResponse};

/// The key a leader holds.
pub const KEY: &str = "/baton/planner/leader";

/// One replica's side of the election.
pub struct EtcdElector {
    client: Client,
    identity: String,
    ttl_secs: i64,
    /// This replica's etcd lease, while it has one that has not expired.
    lease: Option<i64>,
}

impl EtcdElector {
    /// Connects to `endpoints`; `identity` names this replica in the key's value (for
    /// operators; leadership is decided by the lease, not by the name); `ttl`: how long a
    /// silent holder keeps the key (rounded up to whole seconds, etcd's unit).
    pub async fn connect(endpoints: &[String], identity: String, ttl: Duration) -> Result<EtcdElector> {
        if identity.is_empty() {
            bail!("a planner replica needs an identity");
        }
        let opts = ConnectOptions::new().with_connect_timeout(Duration::from_secs(2)).with_timeout(Duration::from_secs(5));
        let client = Client::connect(endpoints, Some(opts)).await.with_context(|| format!("connecting to etcd at {}", endpoints.join(",")))?;
        let ttl_secs = ttl.as_secs_f64().ceil().max(2.0) as i64;
        Ok(EtcdElector { client, identity, ttl_secs, lease: None })
    }

    /// Whether this replica leads for the coming interval; call once per interval,
    /// before acting. Errors mean "not leading" (the caller says why and stands by).
    pub async fn lead(&mut self) -> Result<bool> {
        let lease = match self.renewed().await {
            Ok(id) => id,
            Err(e) => {
                self.lease = None;
                return Err(e);
            }
        };
        let put = TxnOp::put(KEY, self.identity.as_bytes(), Some(PutOptions::new().with_lease(lease)));
        let txn = Txn::new().when([Compare::create_revision(KEY, CompareOp::Equal, 0)]).and_then([put]).or_else([TxnOp::get(KEY, None)]);
        let r = self.client.txn(txn).await.context("the election's transaction")?;
        if r.succeeded() {
            return Ok(true);
        }
        let holder = r.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.lease()),
            _ => None,
        });
        // The key vanished between the compare and the read: nobody holds it; ask again next interval.
        Ok(holder == Some(lease))
    }

    /// This replica's lease, granted if it has none and renewed otherwise; an error when
    /// etcd cannot be reached or the lease had already expired (then a new one is granted
    /// at the next call: the key it held is gone and another replica may hold it now).
    async fn renewed(&mut self) -> Result<i64> {
        let Some(id) = self.lease else {
            let id = self.client.lease_grant(self.ttl_secs, None).await.context("granting the election lease")?.id();
            self.lease = Some(id);
            return Ok(id);
        };
        let (mut keeper, mut stream) = self.client.lease_keep_alive(id).await.context("renewing the election lease")?;
        keeper.keep_alive().await.context("renewing the election lease")?;
        match stream.message().await.context("renewing the election lease")? {
            Some(r) if r.ttl() > 0 => Ok(id),
            _ => bail!("the election lease {id:x} expired (this replica was silent longer than its TTL)"),
        }
    }

    /// Gives up leadership at once (revokes the lease, which deletes the key), e.g. at a
    /// clean shutdown, so another replica need not wait for the TTL.
    pub async fn resign(&mut self) -> Result<()> {
        if let Some(id) = self.lease.take() {
            self.client.lease_revoke(id).await.context("revoking the election lease")?;
        }
        Ok(())
    }
}
