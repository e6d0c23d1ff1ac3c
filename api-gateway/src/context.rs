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
    /// Those tokens: a stored prompt that starts with them began with the platform's
    /// system prompt, and only then is its span platform-shared.
    platform_prefix: Vec<u32>,
}

/// Where a stored history ends, for what is appended after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistoryEnd {
    /// Inside an assistant message (a reply, or an assistant item).
    Reply,
    /// Inside a user message the client added as an item, with no reply after it.
    User,
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
            platform_prefix: vec![],
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
        let first = b.first_turn("")?;
        b.system_span = first.platform_prefix_len;
        b.platform_prefix = first.ids[..first.platform_prefix_len].to_vec();
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
        self.continue_prompt(prev_prompt, prev_output, HistoryEnd::Reply, message)
    }

    /// The next prompt after a stored history that ends as `end` says: its prompt and
    /// output IDs, exactly, then the framing and the new message. The system span is
    /// platform-shared only when the history began with the platform's system prompt
    /// (a conversation started with the client's own instructions shares nothing).
    pub fn continue_prompt(&self, prev_prompt: &[u32], prev_output: &[u32], end: HistoryEnd, message: &str) -> Result<Prompt, ContextError> {
        if !self.template.is_present() {
            return Err(ContextError::Template(TemplateError::Missing.to_string()));
        }
        let mut ids = Vec::with_capacity(prev_prompt.len() + prev_output.len() + 64);
        ids.extend_from_slice(prev_prompt);
        ids.extend_from_slice(prev_output);
        let close = match end {
            HistoryEnd::Reply => self.close_reply_open_user.clone(),
            HistoryEnd::User => self.framing_between(Some("user"), "user")?,
        };
        // A reply that ended on the end-of-turn token already holds it.
        self.push_framing(&mut ids, &close);
        ids.extend(self.encode_content(message)?);
        ids.extend_from_slice(&self.close_user_open_reply);
        let platform_prefix_len = if self.starts_with_platform_prompt(prev_prompt) { self.system_span } else { 0 };
        Ok(Prompt { ids, platform_prefix_len })
    }

    /// Whether a stored prompt began with the platform's system prompt (else with the
    /// client's own instructions).
    pub fn starts_with_platform_prompt(&self, ids: &[u32]) -> bool {
        ids.starts_with(&self.platform_prefix)
    }

    /// Message content as the model reads it (never special tokens).
    pub fn encode_text(&self, s: &str) -> Result<Vec<u32>, ContextError> {
        self.encode_content(s)
    }

    /// The framing between a message of role `prev` (`None`: the system prompt) and
    /// the content of one of role `next`, as the template renders them. A template
    /// that refuses the pair (one that insists on alternating roles) is an error.
    fn framing_between(&self, prev: Option<&str>, next: &str) -> Result<Vec<u32>, ContextError> {
        let (probe, at) = match prev {
            None => (vec![ChatMessage::system("s"), ChatMessage::new(next, "x")], 1),
            Some(p) => (
                vec![ChatMessage::system("s"), ChatMessage::user("u"), ChatMessage::assistant("r"), ChatMessage::new(p, "p"), ChatMessage::new(next, "x")],
                4,
            ),
        };
        let (_, pieces) = self.render_pieces(&probe, false)?;
        self.encode_framing(&pieces[at])
    }

    /// The prompt and output IDs of a turn the client adds as items: after the stored
    /// history `after` (prompt IDs, output IDs, how it ends; `None` for a new
    /// conversation, which starts with the platform's system prompt), a user message,
    /// a reply (already tokenized), or both. The turn's prompt ends where a generated
    /// reply would begin (or inside the user message when there is no reply), so the
    /// next turn appends to it exactly as it appends to a generated one.
    pub fn item_turn(&self, after: Option<(&[u32], &[u32], HistoryEnd)>, user: Option<&str>, reply: Option<&[u32]>) -> Result<(Vec<u32>, Vec<u32>), ContextError> {
        if !self.template.is_present() {
            return Err(ContextError::Template(TemplateError::Missing.to_string()));
        }
        let (mut ids, mut last) = match after {
            Some((p, o, end)) => ([p, o].concat(), Some(if end == HistoryEnd::User { "user" } else { "assistant" })),
            None => {
                let first = user.map_or("assistant", |_| "user");
                let probe = [ChatMessage::system(self.system_prompt.clone()), ChatMessage::new(first, "x")];
                let (_, pieces) = self.render_pieces(&probe, false)?;
                let mut ids = self.encode_framing(&pieces[0])?;
                ids.extend(self.encode_content(&self.system_prompt)?);
                (ids, None)
            }
        };
        if let Some(u) = user {
            let framing = match last {
                Some("assistant") => self.close_reply_open_user.clone(),
                _ => self.framing_between(last, "user")?,
            };
            self.push_framing(&mut ids, &framing);
            ids.extend(self.encode_content(u)?);
            last = Some("user");
        }
        let Some(reply) = reply else { return Ok((ids, vec![])) };
        let framing = match last {
            Some("user") => self.close_user_open_reply.clone(),
            _ => self.framing_between(last, "assistant")?,
        };
        self.push_framing(&mut ids, &framing);
        Ok((ids, reply.to_vec()))
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

    /// A builder over a byte vocabulary with a ChatML template (framing is plain bytes
    /// here, which is all these tests compare).
    fn chatml(dir: &std::path::Path) -> ContextBuilder {
        let path = dir.join("chatml.gguf");
        let mut meta = byte_spm_vocab();
        let t = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}\
                 {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        meta.push(("tokenizer.chat_template", baton_text::gguf::MetaValue::String(t.into())));
        write_gguf(&path, &meta, &[]).unwrap();
        let f = GgufFile::open(&path).unwrap();
        let tok = Arc::new(Tokenizer::from_gguf(&f).unwrap());
        let tmpl = Arc::new(ChatTemplate::from_gguf(&f).unwrap());
        ContextBuilder::new(tok, tmpl, "You are helpful.".into(), 1).unwrap()
    }

    /// Turns added as items continue the history exactly as the template renders the
    /// whole message list, whether a reply follows the user message or not.
    #[test]
    fn item_turns_continue_like_the_template() {
        let dir = tempfile::tempdir().unwrap();
        let b = chatml(dir.path());
        let sys = ChatMessage::system(b.system_prompt.clone());
        let reply = b.encode_text("b").unwrap();
        let (p, o) = b.item_turn(None, Some("a"), Some(&reply)).unwrap();
        assert_eq!(p, b.first_turn("a").unwrap().ids, "a first item turn is the first turn's prompt");
        let next = b.continue_prompt(&p, &o, HistoryEnd::Reply, "c").unwrap();
        let whole = [sys.clone(), ChatMessage::user("a"), ChatMessage::assistant("b"), ChatMessage::user("c")];
        assert_eq!(next.ids, b.encode_messages(&whole).unwrap().ids);
        assert_eq!(next.platform_prefix_len, b.system_span);
        // A user message alone, then another user message.
        let (p, o) = b.item_turn(None, Some("a"), None).unwrap();
        assert!(o.is_empty());
        let next = b.continue_prompt(&p, &o, HistoryEnd::User, "c").unwrap();
        assert_eq!(next.ids, b.encode_messages(&[sys.clone(), ChatMessage::user("a"), ChatMessage::user("c")]).unwrap().ids);
        // An assistant message alone after a reply.
        let (p2, o2) = b.item_turn(Some((&p, &o, HistoryEnd::User)), None, Some(&reply)).unwrap();
        let next = b.continue_prompt(&p2, &o2, HistoryEnd::Reply, "c").unwrap();
        let whole = [sys, ChatMessage::user("a"), ChatMessage::assistant("b"), ChatMessage::user("c")];
        assert_eq!(next.ids, b.encode_messages(&whole).unwrap().ids);
    }

    /// A conversation started with the client's own instructions shares no span with
    /// other users: its later turns mark no platform prefix (the attack: instructions
    /// whose tokens would otherwise be cached under the platform's scope, where another
    /// user's timing could probe them).
    #[test]
    fn only_the_platform_prompt_is_platform_shared() {
        let dir = tempfile::tempdir().unwrap();
        let b = chatml(dir.path());
        let own = b.encode_messages(&[ChatMessage::system("my secret instructions, long enough to fill the span"), ChatMessage::user("hi")]).unwrap();
        assert_eq!(own.platform_prefix_len, 0);
        let next = b.next_turn(&own.ids, &b.encode_text("ok").unwrap(), "more").unwrap();
        assert_eq!(next.platform_prefix_len, 0, "the client's instructions must not be platform-shared");
        let platform = b.first_turn("hi").unwrap();
        assert!(platform.platform_prefix_len > 0);
        assert_eq!(b.next_turn(&platform.ids, &[], "more").unwrap().platform_prefix_len, platform.platform_prefix_len);
    }
}
