//! `NodeControl`, served by every node for the coordinator and operators:
//! Evict (a conversation's KV out of every tier) and Drain (stop taking work,
//! leave the ring, let the running calls finish, then whatever the role hands
//! over). One drain at a time; every step bounded by the drain's deadline.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_engine::kv::ConversationId;
use baton_engine::Engine;
use baton_proto::client::MembershipHandle;
use baton_proto::node as pb;
use baton_proto::node::node_control_server::NodeControl;
use tokio::sync::Mutex;
use tonic::{Request, Response, Status};

use super::{blocking, Node};
use crate::in_flight::{stop_taking_work, InFlight};

/// What a role adds to `NodeControl`.
#[tonic::async_trait]
pub trait ControlHooks: Send + Sync + 'static {
    /// Before `conversation` is evicted from the engine.
    fn evicting(&self, _conversation: &ConversationId) {}

    /// Whether a drain hands anything over after the running calls: then they get
    /// half its deadline, the hand-over the rest.
    fn hands_over(&self) -> bool {
        false
    }

    /// Hands over what the node holds (no new work is taken and the running calls
    /// are done or out of time), by `until`, recording what moved in `out`.
    async fn hand_over(&self, _out: &mut pb::DrainResponse, _until: Instant) {}
}

/// `NodeControl` of a node.
pub(super) struct Control {
    engine: Arc<Engine>,
    hooks: Arc<dyn ControlHooks>,
    draining: Arc<AtomicBool>,
    /// `/healthz` answers 503 once false.
    ready: Arc<AtomicBool>,
    /// Taken (and deregistered) by the first drain.
    membership: Arc<Mutex<Option<MembershipHandle>>>,
    in_flight: InFlight,
    /// Used when the request names no deadline.
    default_deadline: Duration,
    /// One drain at a time.
    running: Mutex<()>,
}

impl Control {
    pub(super) fn new(
        node: &Node,
        hooks: Arc<dyn ControlHooks>,
        ready: Arc<AtomicBool>,
        membership: Arc<Mutex<Option<MembershipHandle>>>,
    ) -> Control {
        Control {
            engine: node.engine.clone(),
            hooks,
            draining: node.draining.clone(),
            ready,
            membership,
            in_flight: node.in_flight.clone(),
            default_deadline: node.config.drain_timeout,
            running: Mutex::new(()),
        }
    }
}

#[tonic::async_trait]
impl NodeControl for Control {
    async fn evict(&self, request: Request<pb::EvictRequest>) -> Result<Response<pb::EvictResponse>, Status> {
        let conversation = baton_proto::ids::conversation(request.into_inner().conversation)?;
        self.hooks.evicting(&conversation);
        let engine = self.engine.clone();
        let freed = blocking(move || engine.evict_conversation(conversation)).await?.map_err(|e| baton_proto::status(&e))?;
        Ok(Response::new(pb::EvictResponse { blocks_freed: freed as u64 }))
    }

    async fn drain(&self, request: Request<pb::DrainRequest>) -> Result<Response<pb::DrainResponse>, Status> {
        let _one = self.running.lock().await;
        let ms = request.into_inner().deadline_ms;
        let deadline = if ms > 0 { Duration::from_millis(ms as u64) } else { self.default_deadline };
        let until = Instant::now() + deadline;
        let deregistered = stop_taking_work(&self.draining, &self.ready, &self.membership).await;
        let mut out = pb::DrainResponse { deregistered, ..Default::default() };
        let for_running = if self.hooks.hands_over() { deadline / 2 } else { deadline };
        // Each call counts until its reply is written (a prefill until its KV is shipped).
        out.running = self.in_flight.wait_idle(for_running).await as u32;
        self.hooks.hand_over(&mut out, until).await;
        Ok(Response::new(out))
    }
}
