//! The admin key: a shared secret that opens an HTTP endpoint meant for operators
//! (`/metrics` on the gateway's public port, the coordinator's `/debug/routing`), where a
//! client certificate is not practical (Prometheus, curl).
//!
//! Read from an environment variable or a file (never a command-line value: those show in
//! `ps`), at least 16 bytes, compared in constant time, and never printed by `Debug`.

use std::fmt;
use std::path::Path;

use ring::digest::{digest, SHA256};
use ring::rand::{SecureRandom, SystemRandom};

use crate::{Error, Result};

/// The environment variable that gives a process its admin key.
pub const ADMIN_KEY_ENV: &str = "BATON_ADMIN_KEY";

/// The shortest admin key accepted, in bytes.
pub const MIN_ADMIN_KEY_BYTES: usize = 16;

/// A shared secret for operators' HTTP endpoints.
#[derive(Clone)]
pub struct AdminKey {
    secret: String,
}

impl fmt::Debug for AdminKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminKey(<redacted>)")
    }
}

/// Equal keys (for comparing configurations; requests use [`AdminKey::admits`]).
impl PartialEq for AdminKey {
    fn eq(&self, other: &AdminKey) -> bool {
        self.admits(Some(&format!("Bearer {}", other.secret)))
    }
}

impl AdminKey {
    /// A key from its text (surrounding whitespace is ignored, as a file's newline).
    pub fn new(text: &str) -> Result<AdminKey> {
        let secret = text.trim();
        if secret.len() < MIN_ADMIN_KEY_BYTES {
            return Err(Error::InvalidAdminKey(format!("it must be at least {MIN_ADMIN_KEY_BYTES} bytes")));
        }
        if secret.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(Error::InvalidAdminKey("it must not contain whitespace or control characters".into()));
        }
        Ok(AdminKey { secret: secret.to_string() })
    }

    /// The key of this process: [`ADMIN_KEY_ENV`], else the contents of `file`.
    pub fn from_env_or_file(file: Option<&Path>) -> Result<Option<AdminKey>> {
        AdminKey::from_sources(std::env::var(ADMIN_KEY_ENV).ok().as_deref(), file)
    }

    /// A fresh random key: 32 bytes from the OS's CSPRNG, as 64 hex digits.
    pub fn generate() -> AdminKey {
        let mut bytes = [0u8; 32];
        SystemRandom::new().fill(&mut bytes).expect("the OS random source failed");
        AdminKey { secret: bytes.iter().map(|b| format!("{b:02x}")).collect() }
    }

    /// The key a process was given: the value of its environment variable, else the
    /// contents of its key file, else none. Both at once is an error (which one wins
    /// would be a guess).
    pub fn from_sources(env_value: Option<&str>, file: Option<&Path>) -> Result<Option<AdminKey>> {
        match (env_value.filter(|v| !v.is_empty()), file) {
            (Some(_), Some(path)) => Err(Error::InvalidAdminKey(format!(
                "both the environment and the file {} give one; keep one",
                path.display()
            ))),
            (Some(v), None) => AdminKey::new(v).map(Some),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|source| Error::Io { what: format!("reading the admin key file {}", path.display()), source })?;
                AdminKey::new(&text).map(Some)
            }
            (None, None) => Ok(None),
        }
    }

    /// The key's text, to hand to an operator once (a file mode 0600, a start banner).
    pub fn reveal(&self) -> &str {
        &self.secret
    }

    /// True when `authorization` (an HTTP `Authorization` header's value) is
    /// `Bearer <this key>`. The comparison takes the same time wherever the two differ:
    /// both sides are hashed first, so neither length nor content leaks through timing.
    pub fn admits(&self, authorization: Option<&str>) -> bool {
        let Some(given) = authorization.and_then(|h| h.strip_prefix("Bearer ")) else {
            return false;
        };
        let (a, b) = (digest(&SHA256, given.trim().as_bytes()), digest(&SHA256, self.secret.as_bytes()));
        a.as_ref().iter().zip(b.as_ref()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_key_is_admitted() {
        let key = AdminKey::new("0123456789abcdef-admin\n").unwrap();
        assert!(key.admits(Some("Bearer 0123456789abcdef-admin")));
        assert!(!key.admits(Some("Bearer 0123456789abcdef-admiN")));
        assert!(!key.admits(Some("Bearer 0123456789abcdef-admin-and-more")));
        assert!(!key.admits(Some("0123456789abcdef-admin")), "the scheme is required");
        assert!(!key.admits(Some("Basic 0123456789abcdef-admin")));
        assert!(!key.admits(None));
    }

    #[test]
    fn weak_or_ambiguous_keys_are_refused() {
        assert!(AdminKey::new("short").is_err());
        assert!(AdminKey::new("a key with spaces in it").is_err());
        let dir = std::env::temp_dir().join(format!("baton-admin-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "file-key-0123456789\n").unwrap();
        assert_eq!(AdminKey::from_sources(None, Some(&file)).unwrap().unwrap().reveal(), "file-key-0123456789");
        assert!(AdminKey::from_sources(Some("env-key-0123456789"), Some(&file)).is_err());
        assert!(AdminKey::from_sources(None, Some(&dir.join("missing"))).is_err());
        assert!(AdminKey::from_sources(Some(""), None).unwrap().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn generated_keys_differ_and_are_never_debug_printed() {
        let (a, b) = (AdminKey::generate(), AdminKey::generate());
        assert_ne!(a.reveal(), b.reveal());
        assert_eq!(a.reveal().len(), 64);
        assert!(!format!("{a:?}").contains(a.reveal()));
    }
}
