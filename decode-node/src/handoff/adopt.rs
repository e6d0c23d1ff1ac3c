//! Adopting a warm conversation from a draining decode node: pull the prefix
//! blocks this node lacks from the source (`ExportPrefix` into a reservation
//! of staging blocks here), then admit a one-token request over the prefix
//! with the blocks as its import, so the engine publishes them to its prefix
//! cache under the conversation's owner and tag. The conversation's next turn
//! then matches them like any warm prefix.
//!
//! The same pull serves a conversation that moved here because this node
//! joined and became its home: its first turn here names the previous owner
//! (`GenerateRequest.prefix_source`) and the prefix is adopted before prefill.
//!
//! What is adopted is the whole blocks both the prompt and the source hold,
//! short of the prompt's last token (the engine computes at least one prompt
//! token itself), past the platform prefix: that one is only ever computed
//! here, and without it nothing is adopted. The source of an `AdoptPrefix` is
//! its caller (the draining node), whatever address the request names, and only once the
//! coordinator vouches ([`vouched`]) that the caller held the conversation for that owner
//! and that it is routed here now. A pull that fails
//! leaves nothing behind: the reservation is released by the transport, and
//! the next turn simply starts cold.

use std::time::{Duration, Instant};

use baton_engine::{Engine, EngineError, Event, KvImport, Request, SubmitOptions};
use baton_proto::node as pb;
use tonic::Status;

use baton_node_common::convert;
use baton_node_common::kv::KvNode;
pub(crate) use baton_node_common::prefix_pull::connect_decode_node as connect;
use baton_node_common::prefix_pull::{first_importable_block, pull_prefix};
use baton_proto::common::NodeId;
use baton_proto::coordinator::VouchAdoptionRequest;
use baton_proto::plane::authz::caller;
use baton_proto::plane::{Expect, Plane, Role};
use baton_proto::Coordinators;
use baton_vocab::{ConversationId, OwnerId};

/// The node an `AdoptPrefix` would pull from, by the caller's certificate: `None` in
/// plaintext mode (no identities, nothing is enforced); a pool certificate names no one
/// node, so the coordinator could not vouch for it: refused.
pub fn source_of<T>(req: &tonic::Request<T>) -> Result<Option<String>, Status> {
    match caller(req) {
        None => Ok(None),
        Some(id) if id.role() == Role::Decode && !id.is_pool() => Ok(Some(id.name().to_string())),
        Some(id) => Err(Status::permission_denied(format!("{id} names no one decode node the coordinator could vouch for"))),
    }
}

/// Asks the coordinator whether this node (by its certificate) may adopt `conversation`
/// of `owner` from `source`. No coordinator, none answering, or a no: refused (the
/// conversation's next turn recomputes its prefix), never adopted unchecked.
pub async fn vouched(coordinator: Option<&Coordinators>, conversation: &ConversationId, owner: &OwnerId, source: &str) -> Result<(), Status> {
    let Some(coordinator) = coordinator else {
        return Err(Status::failed_precondition("no coordinator to vouch for the adoption"));
    };
    let ask = VouchAdoptionRequest {
        routing_key: conversation.as_str().to_string(),
        owner: owner.as_str().to_string(),
        source: Some(NodeId { id: source.to_string() }),
    };
    let answer = coordinator
        .call(|mut c| {
            let ask = ask.clone();
            async move { c.vouch_adoption(ask).await }
        })
        .await?;
    if answer.vouched {
        Ok(())
    } else {
        Err(Status::permission_denied(format!("the coordinator does not vouch for adopting from {source}: {}", answer.why)))
    }
}

/// What an adoption did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Adopted {
    /// Prompt tokens this node held already.
    pub had_tokens: usize,
    /// Prompt tokens pulled from the source.
    pub pulled_tokens: usize,
}

/// An adopted turn from the wire, as the engine takes it.
pub fn request(turn: Option<pb::Turn>) -> Result<Request, Status> {
    let (sampling, ignore_eos) = one_token()?;
    Ok(Request { sampling, ignore_eos, ..convert::request(turn, None)? })
}

/// Greedy, one token: what publishing an adopted prefix computes.
fn one_token() -> Result<(baton_text::sampling::ValidSamplingParams, bool), Status> {
    convert::sampling_params(&pb::SamplingParams { max_tokens: 1, top_p: 1.0, ..Default::default() })
}

/// Makes `req.prompt`'s whole blocks (all but its last token) warm here, as
/// far as the decode node at `source` holds them, pulling what is missing. The
/// source must be the node `holder` names (the caller of `AdoptPrefix`), and the
/// platform prefix is never pulled: without it here, nothing is adopted.
pub async fn adopt(
    engine: &std::sync::Arc<Engine>,
    kv: &KvNode,
    plane: &Plane,
    mut req: Request,
    (source, holder): (&str, Expect),
    deadline: Duration,
) -> Result<Adopted, Status> {
    let started = Instant::now();
    (req.sampling, req.ignore_eos) = one_token()?;
    if req.prompt.is_empty() {
        return Err(Status::invalid_argument("the adopted prefix is empty"));
    }
    if req.conversation.is_none() {
        return Err(Status::invalid_argument("an adopted prefix needs its conversation"));
    }
    let bt = kv.layout.block_tokens as usize;
    if (req.prompt.len() - 1) / bt == 0 {
        return Ok(Adopted::default());
    }
    let e = engine.clone();
    let (prompt, owner, platform) = (req.prompt.clone(), req.owner.clone(), req.platform_prefix_len);
    let had = baton_node_common::shell::blocking(move || e.cached_prefix_tokens(&prompt, &owner, platform)).await?.map_err(|e| baton_proto::status(&e))?;
    let had_blocks = had / bt;
    if had_blocks >= (req.prompt.len() - 1) / bt {
        return Ok(Adopted { had_tokens: had, pulled_tokens: 0 });
    }
    if had_blocks < first_importable_block(req.platform_prefix_len, bt) {
        // Imported blocks would be published under platform scope, which every user's
        // turns read: the conversation's next turn computes its platform prefix here.
        tracing::debug!(had_blocks, "the platform prefix is not held here; nothing adopted");
        return Ok(Adopted { had_tokens: had, pulled_tokens: 0 });
    }
    let mut client =
        tokio::time::timeout(deadline, connect(plane, source, holder.clone())).await.map_err(|_| Status::deadline_exceeded("connecting to the prefix source"))??;
    let peek = pb::CachedPrefixRequest {
        tokens: req.prompt.clone(),
        owner: req.owner.as_str().to_string(),
        platform_prefix_len: req.platform_prefix_len as u32,
    };
    let theirs = tokio::time::timeout(deadline, client.cached_prefix(peek))
        .await
        .map_err(|_| Status::deadline_exceeded("asking the prefix source"))??
        .into_inner();
    let whole = theirs.cached_tokens as usize / bt;
    if whole <= had_blocks {
        return Ok(Adopted { had_tokens: had, pulled_tokens: 0 });
    }
    let left = deadline.saturating_sub(started.elapsed());
    let import = pull_prefix(kv, &mut client, holder, &req.prompt[..whole * bt], &req.owner, req.platform_prefix_len, had_blocks, left).await?;
    let pulled_tokens = import.blocks.len() * bt;
    // One token past the adopted blocks, so the engine computes exactly it.
    req.prompt.truncate(whole * bt + 1);
    req.platform_prefix_len = req.platform_prefix_len.min(req.prompt.len());
    let left = deadline.saturating_sub(started.elapsed());
    tokio::time::timeout(left, publish(engine, req, import)).await.map_err(|_| Status::deadline_exceeded("adopting the prefix"))??;
    Ok(Adopted { had_tokens: had, pulled_tokens })
}

/// Runs the one-token request that publishes the imported blocks.
async fn publish(engine: &Engine, req: Request, import: KvImport) -> Result<(), Status> {
    let sub = match engine.submit_with(req, SubmitOptions { import: Some(import), export_from_block: None }) {
        Ok(s) => s,
        Err(EngineError::BadImport { what }) => return Err(Status::internal(format!("the pulled prefix was refused: {what}"))),
        Err(e) => return Err(baton_proto::status(&e)),
    };
    let mut stream = sub.stream;
    loop {
        match stream.next().await {
            Some(Event::Token(_)) => {}
            Some(Event::Finished { .. }) => return Ok(()),
            Some(Event::Failed(e)) => return Err(baton_proto::status(&e)),
            None => return Err(Status::unavailable("the engine has stopped")),
        }
    }
}
