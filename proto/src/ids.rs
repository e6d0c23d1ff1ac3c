//! Where a wire string becomes an ID: the one function per ID that every gRPC service
//! and client calls, so each ID's rules (those of its `parse` in `baton-vocab`) are
//! applied the same way wherever a message is read, and a bad one is always answered
//! with `INVALID_ARGUMENT`.
//!
//! The other direction needs no function here: an ID goes onto the wire as its
//! `into_string()` (or `as_str()`), which is already checked.

use baton_vocab::{ConversationId, IdError, NodeId, OwnerId};
use tonic::Status;

fn refused(e: IdError) -> Status {
    Status::invalid_argument(e.to_string())
}

/// A conversation named on the wire (a `routing_key` or a `conversation` field).
pub fn conversation(s: String) -> Result<ConversationId, Status> {
    ConversationId::parse(s).map_err(refused)
}

/// A conversation that the message may leave empty (a turn outside any conversation,
/// such as a plain OpenAI request without a derived key): empty is `None`, anything
/// else must be a valid ID.
pub fn optional_conversation(s: String) -> Result<Option<ConversationId>, Status> {
    if s.is_empty() {
        return Ok(None);
    }
    conversation(s).map(Some)
}

/// The owner scope named on the wire. The caller of such an RPC is a Baton process
/// (gateway or node) that took the owner from an API key; the internal plane's mTLS
/// and authorization table decide who may make the call at all.
pub fn owner(s: String) -> Result<OwnerId, Status> {
    OwnerId::parse(s).map_err(refused)
}

/// The node name a `NodeInfo` carries, empty when it names none. Unchecked: where the
/// message came off the wire, the name is read through [`node`].
pub fn node_name(info: &crate::common::NodeInfo) -> &str {
    info.node_id.as_ref().map_or("", |n| n.id.as_str())
}

/// A node named on the wire (a `NodeId` message's `id`, a `source` address's name).
pub fn node(s: String) -> Result<NodeId, Status> {
    NodeId::parse(s).map_err(refused)
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_vocab::ids::MAX_ID_BYTES;
    use tonic::Code;

    /// Strings every conversion must refuse, each with `INVALID_ARGUMENT`.
    fn bad() -> Vec<String> {
        vec![String::new(), "x".repeat(MAX_ID_BYTES + 1), "a\nb".into(), "tab\there".into(), "nul\0".into()]
    }

    fn refused_all<T: std::fmt::Debug>(strings: Vec<String>, convert: impl Fn(String) -> Result<T, Status>) {
        for s in strings {
            let e = convert(s.clone()).expect_err(&format!("{s:?} must be refused"));
            assert_eq!(e.code(), Code::InvalidArgument, "{s:?}: {e:?}");
        }
    }

    #[test]
    fn conversation_keeps_a_good_id_and_refuses_bad_ones() {
        assert_eq!(conversation("conv-1".into()).unwrap().as_str(), "conv-1");
        assert_eq!(conversation("x".repeat(MAX_ID_BYTES)).unwrap().as_str().len(), MAX_ID_BYTES);
        refused_all(bad(), conversation);
    }

    #[test]
    fn optional_conversation_maps_empty_to_none_and_refuses_bad_ones() {
        assert_eq!(optional_conversation(String::new()).unwrap(), None);
        assert_eq!(optional_conversation("c".into()).unwrap().map(ConversationId::into_string), Some("c".to_string()));
        refused_all(bad().into_iter().filter(|s| !s.is_empty()).collect(), optional_conversation);
    }

    #[test]
    fn owner_keeps_a_good_id_and_refuses_bad_ones() {
        assert_eq!(owner("alice".into()).unwrap().as_str(), "alice");
        refused_all(bad(), owner);
    }

    #[test]
    fn node_keeps_a_good_id_and_refuses_bad_ones() {
        assert_eq!(node("decode-0".into()).unwrap().as_str(), "decode-0");
        refused_all(bad(), node);
    }
}
