//! The context builder: turns messages into prompt token IDs.
//!
//! Framing (role markers) comes from the model's chat template, rendered with
//! placeholder contents and split around them; framing is tokenized with
//! special tokens, message contents never are, so a user cannot forge a
//! `<|im_start|>system` turn. A conversation's next prompt is the previous
//! turn's stored prompt IDs + its output IDs + the framing that closes the
//! reply and frames the new message: history is appended, never re-rendered,
//! so the prefix cache always hits. The system-prompt span is the only
//! platform-shared one.

use baton_text::chat_template::{ChatMessage, ChatTemplate, TemplateError};
use baton_text::tokenizer::Tokenizer;
use std::sync::Arc;

/// Why a prompt could not be built (a client error unless `Template`).
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    #[error("the chat template cannot render these messages: {0}")]
    Template(String),
    #[error("tokenizer error: {0}")]
    Tokenize(String),
}

/// A tokenized prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    pub ids: Vec<u32>,
    /// Leading tokens shared across users (the platform's system prompt).
    pub platform_prefix_len: usize,
}

/// How a stored summary is introduced in the prompt.
pub const SUMMARY_PREFIX: &str = "Summary of the earlier conversation: ";

/// The request that asks the model for a summary, appended as a user turn.
pub const SUMMARY_REQUEST: &str = "Summarize our conversation so far in a few sentences, keeping names, facts and decisions.";

fn placeholder(i: usize) -> String {
    format!("\u{E000}{i}\u{E001}")
}

/// Builds prompts for one model's tokenizer and template.
pub struct ContextBuilder {
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    /// The platform's system prompt and its version.
    pub system_prompt: String,
    pub system_prompt_version: u32,
    /// Closes an assistant reply and opens a user message (ChatML: `<|im_end|>\n<|im_start|>user\n`).
    close_reply_open_user: Vec<u32>,
    /// Closes a user message and opens the assistant's reply.
    close_user_open_reply: Vec<u32>,
    /// Tokens of the platform span of a conversation's prompt.
    system_span: usize,
}

impl ContextBuilder {
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        template: Arc<ChatTemplate>,
        system_prompt: String,
        system_prompt_version: u32,
    ) -> Result<Self, ContextError> {
        let mut b = ContextBuilder {
            tokenizer,
            template,
            system_prompt,
            system_prompt_version,
            close_reply_open_user: vec![],
            close_user_open_reply: vec![],
            system_span: 0,
        };
        // A model without a chat template still serves raw prompts; every
        // chat request gets the template's `Missing` error instead.
        if !b.template.is_present() {
            return Ok(b);
        }
        let probe = [ChatMessage::system("s"), ChatMessage::user("u"), ChatMessage::assistant("r"), ChatMessage::user("v")];
        let (_, pieces) = b.render_pieces(&probe, true)?;
        // pieces: framing before each content, then the tail after the last one.
        b.close_reply_open_user = b.encode_framing(&pieces[3])?;
        b.close_user_open_reply = b.encode_framing(&pieces[4])?;
        b.system_span = b.first_turn("")?.platform_prefix_len;
        Ok(b)
    }

    fn encode_framing(&self, s: &str) -> Result<Vec<u32>, ContextError> {
        self.tokenizer.encode(s, true).map_err(|e| ContextError::Tokenize(e.to_string()))
    }

    fn encode_content(&self, s: &str) -> Result<Vec<u32>, ContextError> {
        self.tokenizer.encode(s, false).map_err(|e| ContextError::Tokenize(e.to_string()))
    }

    /// Renders with placeholders; returns the rendered contents in order and
    /// the framing pieces around them (`messages.len() + 1` pieces).
    fn render_pieces(&self, messages: &[ChatMessage], gen: bool) -> Result<(Vec<usize>, Vec<String>), ContextError> {
        let probe: Vec<ChatMessage> = messages.iter().enumerate().map(|(i, m)| ChatMessage::new(m.role.clone(), placeholder(i))).collect();
        let text = self.template.render(&probe, gen).map_err(|e| ContextError::Template(e.to_string()))?;
        let mut pieces = Vec::with_capacity(messages.len() + 1);
        let mut order = Vec::with_capacity(messages.len());
        let mut rest = text.as_str();
        for i in 0..messages.len() {
            let p = placeholder(i);
            let at = rest.find(&p).ok_or_else(|| ContextError::Template(format!("message {i} was dropped by the template")))?;
            pieces.push(rest[..at].to_string());
            order.push(i);
            rest = &rest[at + p.len()..];
        }
        pieces.push(rest.to_string());
        Ok((order, pieces))
    }

    /// Tokenizes whole messages (plain OpenAI requests). The system span is
    /// platform-shared only when it is the platform's own system prompt.
    pub fn encode_messages(&self, messages: &[ChatMessage]) -> Result<Prompt, ContextError> {
        let (order, pieces) = self.render_pieces(messages, true)?;
        let mut ids = Vec::new();
        let mut platform_prefix_len = 0;
        for (k, &i) in order.iter().enumerate() {
            ids.extend(self.encode_framing(&pieces[k])?);
            if k == 1 && messages[0].role == "system" && messages[0].content == self.system_prompt {
                platform_prefix_len = ids.len();
            }
            ids.extend(self.encode_content(&messages[i].content)?);
        }
        ids.extend(self.encode_framing(&pieces[order.len()])?);
        Ok(Prompt { ids, platform_prefix_len })
    }

    /// Appends framing tokens; a reply that ended on the end-of-turn token
    /// already holds the framing's first token.
    fn push_framing(&self, ids: &mut Vec<u32>, framing: &[u32]) {
        match (ids.last(), framing.first()) {
            (Some(&last), Some(&first)) if last == first && self.tokenizer.is_special(last) => ids.extend_from_slice(&framing[1..]),
            _ => ids.extend_from_slice(framing),
        }
    }

    /// The prompt rebuilt at a summary boundary: system prompt, the summary,
    /// the recent turns (user text and the exact reply token IDs), the new
    /// message. Later turns append to it as usual.
    pub fn with_summary(&self, summary: &str, recent: &[(&str, &[u32])], message: &str) -> Result<Prompt, ContextError> {
        let mut msgs = vec![ChatMessage::system(self.system_prompt.clone()), ChatMessage::system(format!("{SUMMARY_PREFIX}{summary}"))];
        for (user, _) in recent {
            msgs.push(ChatMessage::user(*user));
            msgs.push(ChatMessage::assistant(""));
        }
        msgs.push(ChatMessage::user(message));
        let (order, pieces) = self.render_pieces(&msgs, true)?;
        let mut ids = Vec::new();
        let mut platform_prefix_len = 0;
        for (k, &i) in order.iter().enumerate() {
            let framing = self.encode_framing(&pieces[k])?;
            self.push_framing(&mut ids, &framing);
            if k == 1 {
                platform_prefix_len = ids.len();
            }
            if msgs[i].role == "assistant" {
                ids.extend_from_slice(recent[(i - 3) / 2].1);
            } else {
                ids.extend(self.encode_content(&msgs[i].content)?);
            }
        }
        let tail = self.encode_framing(&pieces[order.len()])?;
        self.push_framing(&mut ids, &tail);
        Ok(Prompt { ids, platform_prefix_len })
    }

    /// The prompt of a conversation's first turn.
    pub fn first_turn(&self, message: &str) -> Result<Prompt, ContextError> {
        let msgs = [ChatMessage::system(self.system_prompt.clone()), ChatMessage::user(message)];
        let (order, pieces) = self.render_pieces(&msgs, true)?;
        let mut ids = self.encode_framing(&pieces[0])?;
        ids.extend(self.encode_content(&msgs[order[0]].content)?);
        ids.extend(self.encode_framing(&pieces[1])?);
        let platform_prefix_len = ids.len();
        ids.extend(self.encode_content(message)?);
        ids.extend(self.encode_framing(&pieces[2])?);
        Ok(Prompt { ids, platform_prefix_len })
    }

    /// The output IDs that enter the context: exactly the text the user was
    /// shown. Usually that is every generated ID; a stop string, a held-back
    /// or rewritten chunk (output check, stop button) makes them differ, and
    /// then the longest prefix of IDs that spells a prefix of `shown` is kept
    /// (its KV is still cached) and the rest of `shown` is tokenized.
    pub fn visible_output(&self, output: &[u32], shown: &str) -> Result<Vec<u32>, ContextError> {
        if self.tokenizer.decode(output) == shown {
            return Ok(output.to_vec());
        }
        let bytes = shown.as_bytes();
        let (mut at, mut keep, mut keep_at) = (0, 0, 0);
        for (i, &id) in output.iter().enumerate() {
            if self.tokenizer.is_special(id) {
                break;
            }
            match self.tokenizer.token_piece(id) {
                Some(p) if bytes[at..].starts_with(p) => at += p.len(),
                _ => break,
            }
            // A token may end inside a multi-byte character; cut only between characters.
            if shown.is_char_boundary(at) {
                (keep, keep_at) = (i + 1, at);
            }
        }
        let mut ids = output[..keep].to_vec();
        ids.extend(self.encode_content(&shown[keep_at..])?);
        Ok(ids)
    }

    /// The next prompt: the previous turn's prompt and output IDs, exactly,
    /// then the framing and the new message.
    pub fn next_turn(&self, prev_prompt: &[u32], prev_output: &[u32], message: &str) -> Result<Prompt, ContextError> {
        if !self.template.is_present() {
            return Err(ContextError::Template(TemplateError::Missing.to_string()));
        }
        let mut ids = Vec::with_capacity(prev_prompt.len() + prev_output.len() + 64);
        ids.extend_from_slice(prev_prompt);
        ids.extend_from_slice(prev_output);
        let mut close = self.close_reply_open_user.as_slice();
        // A reply that ended on the end-of-turn token already holds it.
        if let (Some(&last), Some(&first)) = (prev_output.last(), close.first()) {
            if last == first && self.tokenizer.is_special(last) {
                close = &close[1..];
            }
        }
        ids.extend_from_slice(close);
        ids.extend(self.encode_content(message)?);
        ids.extend_from_slice(&self.close_user_open_reply);
        let platform_prefix_len = self.system_span.min(prev_prompt.len());
        Ok(Prompt { ids, platform_prefix_len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_text::gguf::writer::{byte_spm_vocab, write_gguf};
    use baton_text::gguf::GgufFile;

    /// A model with a SentencePiece vocabulary and no chat template: the
    /// builder starts, and every chat prompt is refused with a clear error.
    #[test]
    fn a_model_without_a_template_refuses_chat_prompts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notemplate.gguf");
        write_gguf(&path, &byte_spm_vocab(), &[]).unwrap();
        let f = GgufFile::open(&path).unwrap();
        let tok = Arc::new(Tokenizer::from_gguf(&f).unwrap());
        let tmpl = Arc::new(ChatTemplate::from_gguf(&f).unwrap());
        let b = ContextBuilder::new(tok, tmpl, "You are helpful.".into(), 1).unwrap();
        let no_template = |e: ContextError| {
            let msg = e.to_string();
            assert!(msg.contains("no chat template"), "{msg}");
        };
        no_template(b.encode_messages(&[ChatMessage::user("hi")]).unwrap_err());
        no_template(b.first_turn("hi").unwrap_err());
        no_template(b.next_turn(&[1, 2], &[3], "hi").unwrap_err());
    }
}
