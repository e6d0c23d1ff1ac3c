//! The coordinator's shared state and its gRPC face (`baton.coordinator.Coordinator`).
//!
//! Routing state (ring, placements, prefix affinity, explain log) is plain data behind
//! one mutex, held only for the synchronous decision; membership and eviction calls
//! happen outside it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use baton_proto::common::{LoadReport, NodeId, NodeInfo, Role};
use baton_proto::coordinator as pb;
use baton_proto::coordinator::coordinator_server::Coordinator as CoordinatorRpc;
use baton_proto::ids;
use baton_proto::plane::authz::{caller, caller_key, claim_node};
use baton_proto::plane::Role as IdRole;
use baton_vocab::ConversationId;
use tonic::{Request, Response, Status};

use crate::custody::Custody;
use crate::error::{Error, Result};
use crate::evict::NodeEvictor;
use crate::membership::binding::{self, Claimant};
use crate::membership::{node_id_of, Member, Membership};
use crate::metrics::Metrics;
use crate::placements::{Claim, SharedPlacement, SharedPlacements};
use crate::routing::decode::DecodeRouter;
use crate::routing::explain::{DecisionKind, ExplainLog, ExplainRecord, Reason};
use crate::routing::prefill::{choose_prefill, DecodeHeadroom, PrefillCandidate, PrefillPolicy};
use crate::routing::ring::key_of;
use crate::tombstones::{Ledger, Tombstones};
use crate::Config;

/// Which prefill node last prefilled a conversation, and how many prompt tokens it
/// then held; bounded, oldest forgotten first.
#[derive(Debug)]
struct Affinity {
    cap: usize,
    map: HashMap<u64, (String, u32)>,
    order: VecDeque<u64>,
}

impl Affinity {
    fn new(cap: usize) -> Self {
        Self { cap: cap.max(1), map: HashMap::new(), order: VecDeque::new() }
    }

    fn get(&self, key: u64) -> Option<&(String, u32)> {
        self.map.get(&key)
    }

    fn insert(&mut self, key: u64, node: String, tokens: u32) {
        if self.map.insert(key, (node, tokens)).is_none() {
            self.order.push_back(key);
            while self.order.len() > self.cap {
                if let Some(old) = self.order.pop_front() {
                    self.map.remove(&old);
                }
            }
        }
    }

    fn forget(&mut self, key: u64) {
        self.map.remove(&key);
    }
}

#[derive(Debug)]
struct Routing {
    decode: DecodeRouter,
    affinity: Affinity,
    explain: ExplainLog,
    /// For whom and where conversations were routed, to vouch for adoptions.
    custody: Custody,
}

/// Everything the gRPC and HTTP handlers share.
pub struct State {
    pub(crate) membership: Arc<dyn Membership>,
    pub(crate) metrics: Metrics,
    evictor: Arc<dyn NodeEvictor>,
    policy: PrefillPolicy,
    evict_timeout: Duration,
    routing: Mutex<Routing>,
    /// Decode placements every replica follows (etcd membership); `None`: this is the
    /// only replica and its own placements are the truth.
    placements: Option<Arc<dyn SharedPlacements>>,
    loads: Mutex<HashMap<String, LoadReport>>,
    /// The nodes that may still hold a tombstoned conversation's KV (this replica's view).
    ledger: Mutex<Ledger>,
    /// Deleted conversations not yet evicted everywhere (in etcd: every replica's).
    tombstones: Arc<dyn Tombstones>,
    /// Names one pool certificate may hold (`--pool-certificate-names`; 0: none).
    pool_certificate_names: usize,
    /// Serializes the last check of a name's binding with the write of its lease, so two
    /// registrations of one name through this replica cannot both pass the check.
    registering: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State").field("membership", &self.membership.backend()).finish()
    }
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn role_of(m: &Member) -> Role {
    Role::try_from(m.info.role).unwrap_or(Role::Unspecified)
}

fn role_label(r: Role) -> &'static str {
    match r {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Unspecified => "unspecified",
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl State {
    pub(crate) fn new(
        config: &Config,
        membership: Arc<dyn Membership>,
        placements: Option<Arc<dyn SharedPlacements>>,
        tombstones: Arc<dyn Tombstones>,
        evictor: Arc<dyn NodeEvictor>,
    ) -> Result<Self> {
        let decode = DecodeRouter::new(config.vnodes, config.load_factor, config.conversation_idle_ttl)
            .map_err(|e| Error::Config { field: "load_factor/vnodes", why: e.to_string() })?;
        Ok(Self {
            membership,
            metrics: Metrics::new(),
            evictor,
            policy: PrefillPolicy {
                local_threshold_tokens: config.local_prefill_threshold,
                max_waiting: config.prefill_max_waiting,
                cache_credit: config.prefill_cache_credit,
                ..PrefillPolicy::default()
            },
            evict_timeout: config.evict_timeout,
            routing: Mutex::new(Routing {
                decode,
                affinity: Affinity::new(config.explain_capacity.max(1024) * 16),
                explain: ExplainLog::new(config.explain_capacity),
                custody: Custody::new(crate::custody::CAPACITY),
            }),
            placements,
            loads: Mutex::new(HashMap::new()),
            ledger: Mutex::new(Ledger::new(config.evict_departed_window)),
            tombstones,
            pool_certificate_names: config.pool_certificate_names,
            registering: tokio::sync::Mutex::new(()),
        })
    }

    /// Members with their latest reported load.
    pub(crate) async fn members(&self) -> Result<Vec<Member>> {
        let mut ms = self.membership.members().await?;
        lock(&self.ledger).observe(ms.iter().map(Member::id), Instant::now());
        let loads = lock(&self.loads);
        for m in &mut ms {
            if let Some(l) = loads.get(node_id_of(&m.info)) {
                m.info.load = Some(*l);
            }
        }
        self.metrics.members(ms.iter().map(|m| (m.id(), role_label(role_of(m)))));
        Ok(ms)
    }

    fn record(&self, routing: &mut Routing, rec: ExplainRecord, started: Instant) -> u64 {
        let kind = match rec.kind {
            DecisionKind::Decode => "decode",
            DecisionKind::Prefill => "prefill",
        };
        self.metrics.decision(kind, rec.reason.as_str(), started.elapsed().as_secs_f64());
        tracing::debug!(kind, reason = rec.reason.as_str(), chosen = ?rec.chosen, candidates = rec.candidates.len(), "routing decision");
        routing.explain.push(rec)
    }

    /// Places a turn of `conversation` (read off `req.routing_key` by the RPC handler).
    /// `owner_named`: the caller may name the owner (the gateway), so the owner is
    /// recorded for [`State::vouch_adoption`]; a decode node's owner is not.
    pub(crate) async fn route_decode(&self, conversation: &ConversationId, req: pb::RouteDecodeRequest, owner_named: bool) -> Result<pb::RouteDecodeResponse> {
        let members: Vec<Member> = self.members().await?.into_iter().filter(|m| role_of(m) == Role::Decode).collect();
        let started = Instant::now();
        let exclude: Vec<&str> = req.exclude.iter().map(|n| n.id.as_str()).collect();
        let shared = self.placements.as_ref().and_then(|p| p.get(key_of(conversation)));
        let mut decision = {
            let mut routing = lock(&self.routing);
            routing.decode.set_members(members.iter().map(Member::id));
            routing.decode.expire(started);
            if let Some(s) = &shared {
                routing.decode.adopt(conversation, &s.node, s.revision, started);
            }
            routing.decode.route(conversation, &exclude, started).ok_or(Error::NoNodes { role: "decode" })?
        };
        // A new placement or a move is written down for the other replicas (outside the lock).
        if let Some(store) = &self.placements {
            if shared.as_ref().is_none_or(|s| s.node != decision.node) {
                if let Some(node) = self.claim(store.as_ref(), conversation, &decision.node, shared.as_ref(), &exclude).await {
                    decision.node = node;
                    decision.reason = crate::routing::decode::DecodeReason::Sticky;
                    decision.previous = None;
                }
            }
        }
        let mut routing = lock(&self.routing);
        routing.custody.routed(key_of(conversation), owner_named.then_some(req.owner.as_str()), &decision.node);
        self.metrics.conversations(routing.decode.total());
        let rec = ExplainRecord::decode(conversation, &decision, req.prompt_tokens, unix_ms());
        let mut explanation = to_pb(&rec, Some(conversation));
        explanation.seq = self.record(&mut routing, rec, started);
        drop(routing);
        let info_of = |id: &str| members.iter().find(|m| m.id() == id).map(|m| m.info.clone());
        let node = info_of(&decision.node);
        let previous = decision.previous.as_deref().and_then(info_of);
        Ok(pb::RouteDecodeResponse { node, explanation: Some(explanation), previous })
    }

    /// Records a new placement or move in the shared store. Another replica may have
    /// placed the conversation first: then its node is followed (returned) when it is a
    /// member this turn may use. A store that cannot be reached is logged, not fatal: the
    /// decision stands for this replica and is claimed again on the next turn.
    async fn claim(
        &self,
        store: &dyn SharedPlacements,
        conversation: &ConversationId,
        node: &str,
        shared: Option<&SharedPlacement>,
        exclude: &[&str],
    ) -> Option<String> {
        let key = key_of(conversation);
        match store.claim(key, node, shared.map_or(0, |s| s.revision)).await {
            Ok(Claim::Won(revision)) => {
                lock(&self.routing).decode.set_revision(conversation, revision);
                None
            }
            Ok(Claim::Lost(Some(theirs))) if !exclude.contains(&theirs.node.as_str()) => {
                let mut routing = lock(&self.routing);
                routing.decode.adopt(conversation, &theirs.node, theirs.revision, Instant::now()).then_some(theirs.node)
            }
            Ok(Claim::Lost(_)) => None,
            Err(e) => {
                tracing::warn!(error = %e, "cannot record a placement in the shared store");
                None
            }
        }
    }

    /// Whether `adopter` may pull `conversation`'s KV of `owner` from `source` (see
    /// `crate::custody`): `Err` says why not.
    pub(crate) fn vouch_adoption(&self, conversation: &ConversationId, owner: &str, source: &str, adopter: &str) -> std::result::Result<(), &'static str> {
        lock(&self.routing).custody.vouch(key_of(conversation), owner, source, adopter).map_err(|r| r.why())
    }

    pub(crate) async fn route_prefill(&self, conversation: Option<&ConversationId>, req: pb::RoutePrefillRequest) -> Result<pb::RoutePrefillResponse> {
        // Every turn's tail is decided here, a turn without a conversation too (it has
        // no routing key, hence no prefix affinity).
        let all = self.members().await?;
        // The asking node's ITL standing: as it sent it, else its last keep-alive's.
        let asker = req.decode_node.as_ref().and_then(|n| all.iter().find(|m| m.id() == n.id));
        let decode = req
            .decode_load
            .or_else(|| asker.and_then(|m| m.info.load))
            .and_then(|l| DecodeHeadroom::from_report(l.itl_target_seconds, l.step_p95_seconds, l.prefill_budget_tokens, asker.map_or(0, |m| m.info.block_tokens)));
        let members: Vec<Member> = all.into_iter().filter(|m| role_of(m) == Role::Prefill).collect();
        let started = Instant::now();
        let key = conversation.map(key_of);
        let mut routing = lock(&self.routing);
        let held = key.and_then(|k| routing.affinity.get(k).cloned());
        let candidates = members
            .iter()
            .map(|m| {
                let load = m.info.load.unwrap_or_default();
                PrefillCandidate {
                    node: m.id().to_string(),
                    running: load.running,
                    waiting: load.waiting,
                    kv_blocks_free: load.kv_blocks_free,
                    kv_blocks_total: m.info.kv_blocks_total,
                    cached_tokens: match &held {
                        Some((n, t)) if n == m.id() => *t,
                        _ => 0,
                    },
                }
            })
            .collect();
        let d = choose_prefill(&self.policy, req.prompt_tokens, req.uncached_tokens, decode, candidates);
        if let (Some(node), Some(key)) = (&d.remote, key) {
            routing.affinity.insert(key, node.clone(), req.prompt_tokens);
        }
        let rec = ExplainRecord::prefill(
            conversation,
            &d,
            req.prompt_tokens,
            req.uncached_tokens,
            self.policy.local_threshold_tokens,
            unix_ms(),
        );
        let mut explanation = to_pb(&rec, conversation);
        explanation.seq = self.record(&mut routing, rec, started);
        drop(routing);
        let choice = match d.remote {
            None => pb::route_prefill_response::Choice::Local(pb::LocalPrefill {}),
            Some(n) => match members.into_iter().find(|m| m.id() == n) {
                Some(m) => pb::route_prefill_response::Choice::Remote(m.info),
                None => pb::route_prefill_response::Choice::Local(pb::LocalPrefill {}),
            },
        };
        Ok(pb::RoutePrefillResponse { choice: Some(choice), explanation: Some(explanation) })
    }

    /// Tombstones the conversation, asks every member to evict it, and reports each
    /// member's ack plus the nodes that may hold it but were not asked. The tombstone
    /// clears only when every member acknowledged and none is pending.
    pub(crate) async fn evict(&self, conversation: &ConversationId, req: pb::EvictConversationRequest) -> Result<pb::EvictConversationResponse> {
        {
            let mut routing = lock(&self.routing);
            routing.decode.forget(conversation);
            routing.affinity.forget(key_of(conversation));
            routing.custody.forget(key_of(conversation));
        }
        if let Some(store) = &self.placements {
            if let Err(e) = store.forget(key_of(conversation)).await {
                tracing::warn!(error = %e, "cannot remove a deleted conversation's placement from the shared store");
            }
        }
        // Before the member list is read: a node that registers from here on (through
        // any replica, with etcd) either evicts this tombstone while joining or is
        // reported pending below. Not recorded: no eviction, the caller retries.
        self.tombstones.put(conversation.as_str(), &req.owner).await?;
        let members = self.members().await?;
        let timeout = self.evict_timeout;
        let calls = members.iter().map(|m| {
            let evictor = self.evictor.clone();
            let (key, owner) = (conversation.as_str().to_string(), req.owner.clone());
            let info = m.info.clone();
            async move {
                let r = match tokio::time::timeout(timeout, evictor.evict(&info, &key, &owner)).await {
                    Ok(r) => r,
                    Err(_) => Err(crate::evict::EvictError::Timeout(timeout)),
                };
                let node_id = info.node_id.clone();
                match r {
                    Ok(blocks_freed) => pb::EvictAck { node_id, ok: true, blocks_freed, error: String::new() },
                    Err(e) => pb::EvictAck { node_id, ok: false, blocks_freed: 0, error: e.to_string() },
                }
            }
        });
        let acks: Vec<pb::EvictAck> = futures::future::join_all(calls).await;
        // A member that did not evict may still serve the conversation's prefix: it
        // leaves the ring now, and comes back only through a registration, which
        // evicts every tombstone first.
        for (m, a) in members.iter().zip(&acks) {
            if !a.ok && self.membership.deregister(m.lease_id).await? {
                lock(&self.loads).remove(m.id());
                self.metrics.deregistered(m.id());
                tracing::warn!(node = %m.id(), error = %a.error, "a node did not evict a deleted conversation; removed from the ring until it re-joins");
            }
        }
        let asked: Vec<&str> = members.iter().map(Member::id).collect();
        let pending = lock(&self.ledger).pending(&asked, Instant::now());
        if pending.is_empty() && acks.iter().all(|a| a.ok) {
            // A tombstone left behind is cleared by the caller's next retry, or expires.
            if let Err(e) = self.tombstones.clear(conversation.as_str()).await {
                tracing::warn!(error = %e, "cannot clear an evicted conversation's tombstone");
            }
        }
        self.count_tombstones().await;
        let failed = acks.iter().filter(|a| !a.ok).count();
        let result = match (failed, pending.len()) {
            (0, 0) => "ok",
            (0, _) => "pending",
            _ => "failed",
        };
        self.metrics.eviction(result);
        for a in acks.iter().filter(|a| !a.ok) {
            tracing::warn!(node = ?a.node_id.as_ref().map(|n| &n.id), error = %a.error, "eviction not acknowledged");
        }
        if !pending.is_empty() {
            tracing::info!(nodes = ?pending, "eviction pending on nodes not in the ring");
        }
        let pending = pending.into_iter().map(|id| NodeId { id }).collect();
        Ok(pb::EvictConversationResponse { acks, pending })
    }

    /// Refreshes the tombstone gauge (with etcd, the whole cluster's count).
    pub(crate) async fn count_tombstones(&self) {
        match self.tombstones.count().await {
            Ok(n) => self.metrics.tombstones(n),
            Err(e) => tracing::warn!(error = %e, "cannot count tombstones"),
        }
    }

    /// Evicts every tombstoned conversation on a node that is registering, before it is
    /// a member; while this runs, evictions report the node pending (see [`JoinTicket`]).
    async fn evict_before_join(&self, info: &NodeInfo, owed: &[(String, String)]) -> Result<u64, crate::evict::EvictError> {
        if owed.is_empty() {
            return Ok(0);
        }
        let r = self.evictor.evict_all(info, owed, self.evict_timeout).await;
        self.metrics.join_eviction(if r.is_ok() { "ok" } else { "failed" });
        r
    }

    /// Whether the certificate with `key` may register `name` now (`membership::binding`).
    async fn check_binding(&self, name: &str, key: &[u8], pool: bool) -> Result<()> {
        let members = self.membership.members().await?;
        binding::check(&members, name, Claimant { key, pool }, self.pool_certificate_names).map_err(|refusal| {
            tracing::warn!(node = %name, pool, error = %refusal, "registration refused: the name is bound to another certificate or the certificate holds its limit");
            Error::Binding(refusal)
        })
    }

    pub(crate) fn explain(&self, conversation: &ConversationId, limit: usize) -> Vec<ExplainRecord> {
        lock(&self.routing).explain.for_key(conversation, limit)
    }
}

fn reason_pb(r: Reason) -> pb::Reason {
    match r {
        Reason::Sticky => pb::Reason::Sticky,
        Reason::Home => pb::Reason::Home,
        Reason::Spilled => pb::Reason::Spilled,
        Reason::LocalShortTail => pb::Reason::LocalShortTail,
        Reason::LocalPoolSaturated => pb::Reason::LocalPoolSaturated,
        Reason::LocalNoPrefillNodes => pb::Reason::LocalNoPrefillNodes,
        Reason::RemoteLeastLoaded => pb::Reason::RemoteLeastLoaded,
        Reason::RemoteCachedPrefix => pb::Reason::RemoteCachedPrefix,
        Reason::RemoteDecodeBusy => pb::Reason::RemoteDecodeBusy,
    }
}

/// The wire form of a record; the conversation is the caller's (the log keeps only
/// hashes), empty on the wire for a turn outside any conversation.
pub(crate) fn to_pb(r: &ExplainRecord, conversation: Option<&ConversationId>) -> pb::Explanation {
    pb::Explanation {
        seq: r.seq,
        unix_ms: r.unix_ms,
        kind: match r.kind {
            DecisionKind::Decode => pb::DecisionKind::Decode,
            DecisionKind::Prefill => pb::DecisionKind::Prefill,
        } as i32,
        routing_key: conversation.map_or_else(String::new, |c| c.as_str().to_string()),
        candidates: r
            .candidates
            .iter()
            .map(|c| pb::Candidate {
                node_id: Some(NodeId { id: c.node.clone() }),
                load: c.load,
                cached_tokens: c.cached_tokens,
                score: c.score,
                eligible: c.eligible,
            })
            .collect(),
        chosen: r.chosen.as_ref().map(|n| NodeId { id: n.clone() }),
        reason: reason_pb(r.reason) as i32,
        load_bound: r.load_bound,
        prompt_tokens: r.prompt_tokens,
        uncached_tokens: r.uncached_tokens,
        threshold: r.threshold,
    }
}

/// One registration in flight: while it lives, evictions report the node pending; it
/// ends the registration in the ledger on every path (refusal, error, cancellation).
struct JoinTicket {
    state: Arc<State>,
    node: String,
    admitted: bool,
}

impl JoinTicket {
    fn new(state: Arc<State>, node: &str) -> Self {
        lock(&state.ledger).begin_join(node);
        Self { state, node: node.to_string(), admitted: false }
    }
}

impl Drop for JoinTicket {
    fn drop(&mut self) {
        lock(&self.state.ledger).end_join(&self.node, self.admitted);
    }
}

/// The gRPC service over the shared state.
#[derive(Debug, Clone)]
pub struct CoordinatorService {
    pub(crate) state: Arc<State>,
}

/// The node name is checked apart, by `ids::node` (non-empty among its rules).
fn valid_node(info: &NodeInfo) -> Result<()> {
    if info.grpc_addr.is_empty() {
        return Err(Error::InvalidRequest { what: "grpc_addr is empty" });
    }
    match Role::try_from(info.role) {
        Ok(Role::Prefill | Role::Decode) => Ok(()),
        _ => Err(Error::InvalidRequest { what: "role must be prefill or decode" }),
    }
}

impl CoordinatorService {
    /// A node renews or releases only its own lease: the lease's node, and the node the
    /// request names, must both be the caller's (checked against its certificate).
    async fn lease_holder<T>(&self, req: &Request<T>, lease_id: u64, named: Option<&NodeId>) -> Result<(), Status> {
        if caller(req).is_none() {
            return Ok(()); // plaintext mode: no identities to check
        }
        const EITHER: &[IdRole] = &[IdRole::Prefill, IdRole::Decode];
        // The membership's own list: no loads to merge, no gauges to refresh on a renewal.
        let member = self.state.membership.members().await?.into_iter().find(|m| m.lease_id == lease_id);
        if let Some(m) = &member {
            // The lease is the key's that registered it; and a renewal reports load only
            // under the lease's own node.
            if caller_key(req).is_some_and(|k| m.info.identity_key != k) {
                return Err(Status::permission_denied(format!("lease {lease_id} was registered by another certificate")));
            }
            if named.is_some_and(|n| n.id != node_id_of(&m.info)) {
                return Err(Status::permission_denied(format!("lease {lease_id} does not hold the node the request names")));
            }
        }
        let mut claims: Vec<(String, &[IdRole])> = Vec::new();
        if let Some(m) = &member {
            let role: &[IdRole] = if m.info.role == Role::Prefill as i32 { &[IdRole::Prefill] } else { &[IdRole::Decode] };
            claims.push((node_id_of(&m.info).to_string(), role));
        }
        if let Some(n) = named {
            claims.push((n.id.clone(), EITHER));
        }
        for (node, roles) in claims {
            if !roles.iter().any(|r| claim_node(req, &node, *r).is_ok()) {
                return Err(Status::permission_denied(format!("lease {lease_id} or node {node:?} is not the caller's")));
            }
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl CoordinatorRpc for CoordinatorService {
    async fn register(&self, req: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        let mut info = req.get_ref().node.clone().ok_or(Error::InvalidRequest { what: "node is missing" })?;
        // Node names are read off the wire through `ids::node`, like every ID.
        ids::node(node_id_of(&info).to_string())?;
        valid_node(&info)?;
        // The name and role come from the request; the certificate must allow both.
        let role = if info.role == Role::Prefill as i32 { IdRole::Prefill } else { IdRole::Decode };
        claim_node(&req, node_id_of(&info), role)?;
        let id = node_id_of(&info).to_string();
        // The name is bound to the certificate's key (`membership::binding`): the key
        // comes from the handshake, never from the request.
        let key = caller_key(&req);
        info.identity_key = key.map_or_else(Vec::new, |k| k.to_vec());
        let pool = caller(&req).is_some_and(|c| c.is_pool());
        if key.is_some() {
            self.state.check_binding(&id, &info.identity_key, pool).await?;
        }
        // A (re)joining node may hold KV of conversations deleted while it was away:
        // it evicts every tombstoned one before it is a member, so nothing is routed to
        // it (nor pulled from it) in between. If it cannot, it is not admitted yet.
        // The tombstones are read once the node counts as joining (see `Ledger::begin_join`);
        // unreadable, the node is refused and retries: it may owe an eviction.
        let mut ticket = JoinTicket::new(self.state.clone(), &id);
        let owed = self.state.tombstones.outstanding().await.map_err(|e| {
            tracing::warn!(node = %id, error = %e, "cannot read the tombstones a joining node must evict; not admitted");
            Status::from(e)
        })?;
        let freed = self.state.evict_before_join(&info, &owed).await.map_err(|e| {
            tracing::warn!(node = %id, tombstones = owed.len(), error = %e, "a joining node could not evict tombstoned conversations; not admitted");
            Status::unavailable(format!("evict {} tombstoned conversations before joining: {e}", owed.len()))
        })?;
        if let Some(l) = info.load {
            lock(&self.state.loads).insert(id.clone(), l);
        }
        let serial = self.state.registering.lock().await;
        if key.is_some() {
            // Again, as the lease is written: another registration may have come first.
            self.state.check_binding(&id, &info.identity_key, pool).await?;
        }
        let lease = self.state.membership.register(info).await?;
        drop(serial);
        ticket.admitted = true;
        drop(ticket);
        self.state.metrics.registration();
        tracing::info!(node = %id, lease_id = lease.id, tombstones_evicted = owed.len(), blocks_freed = freed, "node registered");
        Ok(Response::new(pb::RegisterResponse {
            lease_id: lease.id,
            ttl_ms: lease.ttl.as_millis().min(u32::MAX as u128) as u32,
            tombstones_evicted: owed.len().min(u32::MAX as usize) as u32,
        }))
    }

    async fn keep_alive(&self, req: Request<pb::KeepAliveRequest>) -> Result<Response<pb::KeepAliveResponse>, Status> {
        self.lease_holder(&req, req.get_ref().lease_id, req.get_ref().node_id.as_ref()).await?;
        let req = req.into_inner();
        let alive = self.state.membership.keep_alive(req.lease_id).await?;
        if alive {
            if let (Some(n), Some(l)) = (req.node_id, req.load) {
                lock(&self.state.loads).insert(n.id, l);
            }
        }
        let result = if alive { "ok" } else { "unknown_lease" };
        self.state.metrics.renewal(result);
        let status = if alive { pb::KeepAliveStatus::Ok } else { pb::KeepAliveStatus::UnknownLease };
        let ttl_ms = self.state.membership.ttl().as_millis().min(u32::MAX as u128) as u32;
        Ok(Response::new(pb::KeepAliveResponse { status: status as i32, ttl_ms }))
    }

    async fn deregister(&self, req: Request<pb::DeregisterRequest>) -> Result<Response<pb::DeregisterResponse>, Status> {
        self.lease_holder(&req, req.get_ref().lease_id, req.get_ref().node_id.as_ref()).await?;
        let req = req.into_inner();
        let removed = self.state.membership.deregister(req.lease_id).await?;
        if removed {
            if let Some(n) = req.node_id {
                lock(&self.state.loads).remove(&n.id);
                self.state.metrics.deregistered(&n.id);
                tracing::info!(node = %n.id, "node deregistered");
            }
        }
        Ok(Response::new(pb::DeregisterResponse { removed }))
    }

    // Each routing key is read once, here, into a `ConversationId` (and each node name
    // checked as a `NodeId`); below this the coordinator only sees the typed ID (and
    // keeps only its hash).
    async fn route_decode(&self, req: Request<pb::RouteDecodeRequest>) -> Result<Response<pb::RouteDecodeResponse>, Status> {
        // A decode node (draining) may move a conversation away from itself only: an
        // exclude list naming other nodes would let it steer a conversation to itself.
        if let Some(id) = caller(&req).filter(|id| id.role() == IdRole::Decode) {
            if let Some(other) = req.get_ref().exclude.iter().find(|n| !id.may_act_as(&n.id)) {
                return Err(Status::permission_denied(format!("a decode node may exclude only itself, not {:?}", other.id)));
            }
        }
        // Only the gateway (or anyone, in plaintext mode) names the owner it routes for.
        let owner_named = caller(&req).is_none_or(|id| id.role() == IdRole::Gateway);
        let mut req = req.into_inner();
        let conversation = ids::conversation(std::mem::take(&mut req.routing_key))?;
        for node in &req.exclude {
            ids::node(node.id.clone())?;
        }
        Ok(Response::new(self.state.route_decode(&conversation, req, owner_named).await?))
    }

    async fn vouch_adoption(&self, req: Request<pb::VouchAdoptionRequest>) -> Result<Response<pb::VouchAdoptionResponse>, Status> {
        // The adopter is the caller's certificate, never a field: a pool certificate
        // names no one node, and plaintext mode names none at all.
        let adopter = match caller(&req) {
            Some(id) if id.role() == IdRole::Decode && !id.is_pool() => id.name().to_string(),
            _ => return Err(Status::permission_denied("only a decode node's own certificate may ask to adopt a conversation")),
        };
        let req = req.into_inner();
        let conversation = ids::conversation(req.routing_key)?;
        let owner = ids::owner(req.owner)?;
        let source = ids::node(req.source.map(|n| n.id).unwrap_or_default())?;
        let answer = self.state.vouch_adoption(&conversation, owner.as_str(), source.as_str(), &adopter);
        if let Err(why) = answer {
            tracing::warn!(adopter, source = source.as_str(), why, "adoption not vouched for");
        }
        Ok(Response::new(pb::VouchAdoptionResponse { vouched: answer.is_ok(), why: answer.err().unwrap_or_default().to_string() }))
    }

    async fn route_prefill(&self, req: Request<pb::RoutePrefillRequest>) -> Result<Response<pb::RoutePrefillResponse>, Status> {
        let mut req = req.into_inner();
        let conversation = ids::optional_conversation(std::mem::take(&mut req.routing_key))?;
        Ok(Response::new(self.state.route_prefill(conversation.as_ref(), req).await?))
    }

    async fn evict_conversation(
        &self,
        req: Request<pb::EvictConversationRequest>,
    ) -> Result<Response<pb::EvictConversationResponse>, Status> {
        let mut req = req.into_inner();
        let conversation = ids::conversation(std::mem::take(&mut req.routing_key))?;
        Ok(Response::new(self.state.evict(&conversation, req).await?))
    }

    async fn list_nodes(&self, req: Request<pb::ListNodesRequest>) -> Result<Response<pb::ListNodesResponse>, Status> {
        let role = req.into_inner().role;
        let nodes = self
            .state
            .members()
            .await?
            .into_iter()
            .filter(|m| role == Role::Unspecified as i32 || m.info.role == role)
            .map(|m| m.info)
            .collect();
        Ok(Response::new(pb::ListNodesResponse { nodes }))
    }

    async fn explain(&self, req: Request<pb::ExplainRequest>) -> Result<Response<pb::ExplainResponse>, Status> {
        let req = req.into_inner();
        let conversation = ids::conversation(req.routing_key)?;
        let records = self
            .state
            .explain(&conversation, req.limit as usize)
            .iter()
            .map(|r| to_pb(r, Some(&conversation)))
            .collect();
        Ok(Response::new(pb::ExplainResponse { records }))
    }
}

#[cfg(test)]
#[path = "service_tests.rs"]
mod tests;
