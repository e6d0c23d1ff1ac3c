//! Identifiers that cross crate and process boundaries.
//!
//! Each is its own type, so a conversation can never be passed where an owner is
//! expected. A string from the wire or a flag becomes an ID only through `parse`, which
//! holds that ID's rules; code that builds an ID from a value it made itself (a fresh
//! UUID, a certificate's name) uses the same `parse`, so no ID escapes the rules.

use std::fmt;

/// Why a string is not a valid ID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{what} is empty")]
    Empty { what: &'static str },
    #[error("{what} is {len} bytes, more than {max}")]
    TooLong { what: &'static str, len: usize, max: usize },
    #[error("{what} contains a control character")]
    Control { what: &'static str },
}

impl crate::HasKind for IdError {
    fn kind(&self) -> crate::ErrorKind {
        crate::ErrorKind::InvalidArgument
    }
}

/// The longest ID accepted: far above any ID Baton makes, low enough that an ID can
/// never be a way to push large data into logs, labels or keys.
pub const MAX_ID_BYTES: usize = 256;

fn check(what: &'static str, s: &str) -> Result<(), IdError> {
    if s.is_empty() {
        return Err(IdError::Empty { what });
    }
    if s.len() > MAX_ID_BYTES {
        return Err(IdError::TooLong { what, len: s.len(), max: MAX_ID_BYTES });
    }
    if s.chars().any(char::is_control) {
        return Err(IdError::Control { what });
    }
    Ok(())
}

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            /// Checks `s` against the ID's rules (non-empty, at most
            /// [`MAX_ID_BYTES`], no control characters).
            pub fn parse(s: impl Into<String>) -> Result<Self, IdError> {
                let s = s.into();
                check($what, &s)?;
                Ok(Self(s))
            }

            /// The ID as a string slice (for the wire, keys and labels).
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The ID as an owned string (for the wire).
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

string_id!(
    /// A conversation: the routing key of the decode ring, the scope of a warm prefix
    /// and the unit of deletion.
    ConversationId,
    "conversation id"
);
string_id!(
    /// The authenticated owner a request runs for. Comes from an API key or a session,
    /// never from a field the client fills in; KV blocks are scoped by it.
    OwnerId,
    "owner id"
);
string_id!(
    /// A node of the cluster, as named by its certificate.
    NodeId,
    "node id"
);
string_id!(
    /// One turn of a conversation (a request's idempotency and resume key).
    TurnId,
    "turn id"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_enforces_the_rules() {
        assert_eq!(ConversationId::parse("c1").unwrap().as_str(), "c1");
        assert_eq!(OwnerId::parse(""), Err(IdError::Empty { what: "owner id" }));
        assert!(matches!(NodeId::parse("x".repeat(MAX_ID_BYTES + 1)), Err(IdError::TooLong { .. })));
        assert!(matches!(TurnId::parse("a\nb"), Err(IdError::Control { .. })));
        assert!(NodeId::parse("x".repeat(MAX_ID_BYTES)).is_ok());
    }
}
