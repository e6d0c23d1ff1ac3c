//! What `logprobs` may tell a client: text that went through the same output filter as
//! the reply, and never a special token's spelling.
//!
//! A token's own entry carries the text that token released from the reply's
//! [`OutputFilter`] (the pipeline fills it), so the entries of a reply, concatenated,
//! are a prefix of its sanitized content: a construct the sanitizer stripped from the
//! content is stripped from the logprobs too (issue #39: the raw token strings spelled
//! out a removed `<img>` and `<|im_end|>`).
//!
//! The top alternatives are text the model did not write, so no content filter has
//! seen them. Each rank (the most likely alternative, the second, ...) is read as a
//! reply of its own: rank `r`'s alternatives in order pass through an
//! [`OutputFilter`] of their own, and each alternative carries what it released there.
//! Whatever sequence of strings a client concatenates (the chosen tokens, or one rank
//! of alternatives), it reads filtered text; held text that is never released is
//! never sent; a rank whose output check fires sends no more text.
//! Special tokens (end of turn and the like) add no text anywhere.

use crate::checks::{ContentCheck, Filtered, LinkPolicy, OutputFilter};
use baton_text::tokenizer::Tokenizer;
use std::sync::Arc;

/// One alternative as sent: its ID, log-probability and filtered text.
#[derive(Clone, Debug, PartialEq)]
pub struct Alternative {
    pub id: u32,
    pub logprob: f32,
    pub text: String,
}

/// One rank's filter and the bytes of a character split across tokens.
struct Rank {
    filter: OutputFilter,
    pending: Vec<u8>,
    blocked: bool,
}

/// The filters of a reply's alternative ranks (created as ranks appear).
pub struct AlternativesFilter {
    tokenizer: Arc<Tokenizer>,
    check: Arc<dyn ContentCheck>,
    links: Arc<LinkPolicy>,
    window: usize,
    ranks: Vec<Rank>,
}

impl AlternativesFilter {
    pub fn new(tokenizer: Arc<Tokenizer>, check: Arc<dyn ContentCheck>, links: Arc<LinkPolicy>, window: usize) -> Self {
        AlternativesFilter { tokenizer, check, links, window, ranks: Vec::new() }
    }

    /// The alternatives of one position, in rank order, each with the text it released.
    pub fn push(&mut self, alternatives: &[(u32, f32)]) -> Vec<Alternative> {
        while self.ranks.len() < alternatives.len() {
            let filter = OutputFilter::new(self.check.clone(), self.links.clone(), self.window);
            self.ranks.push(Rank { filter, pending: Vec::new(), blocked: false });
        }
        let mut out = Vec::with_capacity(alternatives.len());
        for (rank, &(id, logprob)) in self.ranks.iter_mut().zip(alternatives) {
            let bytes = if self.tokenizer.is_special(id) { Vec::new() } else { self.tokenizer.token_bytes(id).unwrap_or_default() };
            let text = rank.push(&bytes);
            out.push(Alternative { id, logprob, text });
        }
        out
    }
}

impl Rank {
    fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let text = take_utf8(&mut self.pending);
        if self.blocked || text.is_empty() {
            return String::new();
        }
        match self.filter.push(&text) {
            Filtered::Text(t) => t,
            Filtered::Blocked(_) => {
                self.blocked = true;
                String::new()
            }
        }
    }
}

/// The complete characters at the front of `buf` (invalid bytes become U+FFFD); an
/// incomplete character at the end stays in `buf` for the next token.
fn take_utf8(buf: &mut Vec<u8>) -> String {
    let mut out = String::new();
    loop {
        match std::str::from_utf8(buf) {
            Ok(s) => {
                out.push_str(s);
                buf.clear();
                return out;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(std::str::from_utf8(&buf[..valid]).unwrap_or_default());
                match e.error_len() {
                    // An incomplete character at the end: wait for its other bytes.
                    None => {
                        buf.drain(..valid);
                        return out;
                    }
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        buf.drain(..valid + n);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn characters_split_across_tokens_are_joined() {
        let mut buf = "é".as_bytes()[..1].to_vec();
        assert_eq!(take_utf8(&mut buf), "");
        buf.extend_from_slice(&"é".as_bytes()[1..]);
        buf.extend_from_slice(b"x\xff");
        assert_eq!(take_utf8(&mut buf), "éx\u{fffd}");
        assert!(buf.is_empty());
    }
}
