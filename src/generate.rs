//! `baton generate`: a prompt or chat messages in, streamed text out.

use crate::engine_args::EngineArgs;
use anyhow::{bail, Context, Result};
use baton_text::chat_template::ChatMessage;
use baton_engine::kv::OwnerId;
use baton_text::sampling::SamplingParams;
use baton_engine::{Event, Request};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Raw prompt text, tokenized as is (no chat template), after BOS when the model asks for it.
    #[arg(long, conflicts_with_all = ["user", "messages"])]
    pub prompt: Option<String>,
    /// A user message, rendered with the model's chat template.
    #[arg(long)]
    pub user: Option<String>,
    /// A system message to put before the user message.
    #[arg(long, requires = "user")]
    pub system: Option<String>,
    /// A JSON file with a list of {"role", "content"} messages.
    #[arg(long, conflicts_with = "user")]
    pub messages: Option<PathBuf>,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// A string that ends generation (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Report this many most likely alternatives per token (implies --json detail).
    #[arg(long, default_value_t = 0)]
    pub top_logprobs: usize,
    /// Print one JSON object per token (ID, text, logprob, alternatives),
    /// then a summary object, instead of plain text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let engine = a.engine.start()?;
    // A raw prompt is tokenized as `/v1/completions` does (BOS by the model's rule);
    // a rendered chat template carries its own BOS.
    let prompt = if let Some(p) = &a.prompt {
        engine.tokenizer.encode_prompt(p)?
    } else {
        let messages: Vec<ChatMessage> = if let Some(path) = &a.messages {
            let raw = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str(&raw).with_context(|| format!("{}: expected a JSON list of {{role, content}}", path.display()))?
        } else if let Some(u) = &a.user {
            let mut m = Vec::new();
            if let Some(s) = &a.system {
                m.push(ChatMessage::new("system", s));
            }
            m.push(ChatMessage::new("user", u));
            m
        } else {
            bail!("give --prompt, --user or --messages");
        };
        engine.tokenizer.encode(&engine.template.render(&messages, true)?, true)?
    };
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        max_tokens: a.max_tokens,
        stop_strings: a.stop.clone(),
        logprobs: a.json || a.top_logprobs > 0,
        top_logprobs: a.top_logprobs,
        ..SamplingParams::default()
    }
    .validate()?;
    let mut stream = engine.submit(Request {
        prompt: prompt.clone(),
        owner: OwnerId::parse("local")?,
        platform_prefix_len: 0,
        conversation: None,
        sampling,
        ignore_eos: false,
    })?;
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::json!({ "prompt_tokens": prompt }))?;
    }
    while let Some(ev) = stream.blocking_next() {
        match ev {
            Event::Token(t) => {
                if a.json {
                    let top: Vec<_> = t.top_logprobs.iter().map(|(id, lp)| serde_json::json!({ "id": id, "logprob": lp })).collect();
                    writeln!(out, "{}", serde_json::json!({ "id": t.id, "text": t.text, "logprob": t.logprob, "top_logprobs": top, "elapsed_ms": t.elapsed.as_secs_f64() * 1e3 }))?;
                } else {
                    write!(out, "{}", t.text)?;
                    out.flush()?;
                }
            }
            Event::Finished { reason, usage, ttft, total, trailing_text, .. } => {
                if a.json {
                    writeln!(out, "{}", serde_json::json!({
                        "finish_reason": reason.as_str(),
                        "trailing_text": trailing_text,
                        "prompt_tokens": usage.prompt_tokens,
                        "cached_tokens": usage.cached_tokens,
                        "completion_tokens": usage.completion_tokens,
                        "ttft_ms": ttft.map(|d| d.as_secs_f64() * 1e3),
                        "total_ms": total.as_secs_f64() * 1e3,
                    }))?;
                } else {
                    writeln!(out, "{trailing_text}")?;
                }
                break;
            }
            Event::Failed(e) => bail!(e),
        }
    }
    engine.shutdown();
    Ok(())
}
