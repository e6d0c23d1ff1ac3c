//! Leader election for `baton plan --apply kubernetes`: one `coordination.k8s.io/v1` Lease
//! (`baton-planner`, created by the manifests), so two planner replicas never both patch the
//! pools.
//!
//! Every interval a replica reads the Lease. It leads when the Lease names it (it then
//! renews it), or when the holder has not renewed it for `leaseDurationSeconds` as measured
//! on this replica's own monotonic clock since the Lease last changed (no comparison of two
//! machines' wall clocks), in which case it takes it over. Renewals and takeovers are
//! `PUT`s carrying the `resourceVersion` read: of two replicas racing, the API server accepts
//! one and answers the other 409, which then stands by. A replica that cannot reach the API
//! does not lead (it cannot act either). The Role allows `get` and `update` on this one
//! Lease and nothing else (`deploy/k8s/planner/rbac.yaml`).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Result};
use reqwest::{Method, StatusCode};

use super::kube::KubeScaler;

/// The Lease's name.
pub const LEASE: &str = "baton-planner";

/// RFC 3339 with microseconds (a Kubernetes MicroTime) of a unix time.
pub fn micro_time(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

/// One replica's view of the Lease.
pub struct Elector {
    identity: String,
    duration: Duration,
    /// The Lease's resourceVersion when last read, and since when (this clock) it has not changed.
    seen: Option<(String, Instant)>,
}

impl Elector {
    /// `identity`: this replica (its pod name); `duration`: how long a holder's silence
    /// lasts before another replica takes over (a few intervals).
    pub fn new(identity: String, duration: Duration) -> Result<Elector> {
        if identity.is_empty() || identity.len() > 253 {
            bail!("the planner's identity for the Lease must be 1 to 253 characters");
        }
        Ok(Elector { identity, duration, seen: None })
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Reads the Lease and renews or takes it when this replica may: whether it leads now.
    pub async fn lead(&mut self, k: &KubeScaler) -> Result<bool> {
        let path = format!("/apis/coordination.k8s.io/v1/namespaces/{}/leases/{LEASE}", k.namespace());
        let (status, lease) = k.raw(Method::GET, &path, None).await?;
        if status == StatusCode::NOT_FOUND {
            bail!("Lease {LEASE} not found: the manifests create it (deploy/k8s/planner/rbac.yaml)");
        }
        if !status.is_success() {
            bail!("reading Lease {LEASE}: the Kubernetes API answered {status}: {}", lease["message"].as_str().unwrap_or("(no message)"));
        }
        let version = lease["metadata"]["resourceVersion"].as_str().unwrap_or("").to_string();
        let holder = lease["spec"]["holderIdentity"].as_str().unwrap_or("");
        let now = Instant::now();
        let unchanged_since = match &self.seen {
            Some((v, since)) if *v == version => *since,
            _ => now,
        };
        self.seen = Some((version.clone(), unchanged_since));
        let mine = holder == self.identity;
        let expired = holder.is_empty() || now.duration_since(unchanged_since) >= self.duration;
        if !mine && !expired {
            return Ok(false);
        }
        let stamp = micro_time(SystemTime::now());
        let mut next = lease.clone();
        next["spec"]["holderIdentity"] = self.identity.clone().into();
        next["spec"]["leaseDurationSeconds"] = (self.duration.as_secs().max(1) as i64).into();
        next["spec"]["renewTime"] = stamp.clone().into();
        if !mine {
            next["spec"]["acquireTime"] = stamp.into();
            let t = next["spec"]["leaseTransitions"].as_i64().unwrap_or(0);
            next["spec"]["leaseTransitions"] = (t + 1).into();
        }
        let (status, answer) = k.raw(Method::PUT, &path, Some(&next)).await?;
        if status == StatusCode::CONFLICT {
            // Another replica renewed or took it between our read and write.
            return Ok(false);
        }
        if !status.is_success() {
            bail!("updating Lease {LEASE}: the Kubernetes API answered {status}: {}", answer["message"].as_str().unwrap_or("(no message)"));
        }
        if let Some(v) = answer["metadata"]["resourceVersion"].as_str() {
            self.seen = Some((v.to_string(), Instant::now()));
        }
        Ok(true)
    }
}
