//! A `POST /v1/responses` body, parsed and validated (pure: unit-tested without a
//! server). Every top-level field is in [`FIELDS`]: served, accepted only at the value
//! that asks for nothing Baton lacks (`tools: []`, `background: false`, ...), or refused;
//! a field not in the table is refused too. A refusal is a 400 naming the field, never a
//! silent drop: a client that asked for tools, images or a JSON schema learns at once.

use crate::error::ApiError;
use baton_text::chat_template::ChatMessage;
use baton_text::sampling::SamplingParams;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// What the gateway does with one top-level field.
#[derive(Clone, Copy)]
pub enum Rule {
    /// Served (read below).
    Served,
    /// Accepted only when the value asks for nothing Baton lacks; else the reason.
    OnlyIf(fn(&Value) -> bool, &'static str),
    /// Refused whatever its value (`null` aside).
    Refused(&'static str),
}

fn empty_array(v: &Value) -> bool {
    v.as_array().is_some_and(|a| a.is_empty())
}

fn no_tool_choice(v: &Value) -> bool {
    matches!(v.as_str(), Some("none" | "auto"))
}

fn plain_text_format(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    o.iter().all(|(k, v)| match k.as_str() {
        "format" => v.is_null() || v.get("type").and_then(Value::as_str) == Some("text") && v.as_object().is_some_and(|f| f.len() == 1),
        "verbosity" => v.is_null() || v.as_str() == Some("medium"),
        _ => false,
    })
}

/// Every top-level field of the request body and what Baton does with it.
pub const FIELDS: &[(&str, Rule)] = &[
    ("model", Rule::Served), // one model is served; the name is not checked, as for chat
    ("input", Rule::Served),
    ("instructions", Rule::Served),
    ("previous_response_id", Rule::Served),
    ("conversation", Rule::Served),
    ("max_output_tokens", Rule::Served),
    ("temperature", Rule::Served),
    ("top_p", Rule::Served),
    ("store", Rule::Served),
    ("stream", Rule::Served),
    ("metadata", Rule::Served),
    ("truncation", Rule::Served),
    ("user", Rule::Served), // an end-user label for the operator's logs; never an identity
    ("safety_identifier", Rule::Served), // the same, under its newer name
    ("stream_options", Rule::OnlyIf(|v| v.as_object().is_some_and(|o| o.keys().all(|k| k == "include_obfuscation")), "only include_obfuscation is accepted (deltas carry no obfuscation padding)")),
    ("tools", Rule::OnlyIf(empty_array, "tools are not supported")),
    ("tool_choice", Rule::OnlyIf(no_tool_choice, "tools are not supported (tool_choice may only be \"none\" or \"auto\")")),
    ("parallel_tool_calls", Rule::OnlyIf(Value::is_boolean, "tools are not supported")),
    ("max_tool_calls", Rule::Refused("tools are not supported")),
    ("background", Rule::OnlyIf(|v| v == &Value::Bool(false), "background responses are not supported")),
    ("background_options", Rule::Refused("background responses are not supported")),
    ("reasoning", Rule::Refused("reasoning options are not supported")),
    ("text", Rule::OnlyIf(plain_text_format, "only text.format {\"type\": \"text\"} is supported (no json_schema or json_object)")),
    ("include", Rule::OnlyIf(empty_array, "include is not supported")),
    ("top_logprobs", Rule::OnlyIf(|v| v.as_u64() == Some(0), "logprobs are not offered on /v1/responses (use /v1/chat/completions)")),
    ("prompt", Rule::Refused("stored prompt templates are not supported")),
    ("prompt_cache_key", Rule::Refused("the cache key is the conversation (pass previous_response_id or conversation)")),
    ("prompt_cache_retention", Rule::Refused("cache retention is the operator's (--retention-days)")),
    ("prompt_cache_options", Rule::Refused("cache retention is the operator's (--retention-days)")),
    ("service_tier", Rule::OnlyIf(|v| matches!(v.as_str(), Some("auto" | "default")), "service tiers are not supported")),
    ("context_management", Rule::Refused("context management is the operator's (summaries)")),
    ("moderation", Rule::Refused("moderation is the operator's (--check-rules)")),
    ("image", Rule::Refused("image generation is not supported")),
    ("access_programs", Rule::Refused("not supported")),
];

/// A validated request.
#[derive(Debug, Clone)]
pub struct ResponseRequest {
    /// The input items in order (roles mapped as chat maps them: `developer` is `system`).
    pub messages: Vec<ChatMessage>,
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub conversation: Option<String>,
    pub sampling: SamplingParams,
    pub max_output_tokens: Option<u32>,
    pub store: bool,
    pub stream: bool,
    pub metadata: Map<String, Value>,
    pub truncation: String,
    /// SHA-256 of the body without `stream` (a retry may change the mode): the
    /// idempotency check's 409 compares it.
    pub hash: String,
}

impl ResponseRequest {
    /// The user message a continued response adds: exactly one user message.
    pub fn single_user_message(&self) -> Result<&str, ApiError> {
        match self.messages.as_slice() {
            [m] if m.role == "user" => Ok(&m.content),
            _ => Err(ApiError::bad_param(
                "input",
                "a response that continues a conversation (previous_response_id or conversation) takes one user message as input",
            )),
        }
    }
}

fn refuse(field: &'static str, why: &str) -> ApiError {
    ApiError::bad_param(field, format!("{field}: {why}"))
}

fn parse_input(v: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match v {
        Value::String(s) => return Ok(vec![ChatMessage::user(s.clone())]),
        Value::Array(items) => items,
        _ => return Err(refuse("input", "must be a string or a list of message items")),
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        if kind != "message" {
            return Err(refuse("input", &format!("input[{i}]: items of type {kind} are not supported (messages only)")));
        }
        let role = match item.get("role").and_then(Value::as_str) {
            Some("user") => "user",
            Some("system" | "developer") => "system",
            Some("assistant") => "assistant",
            other => return Err(refuse("input", &format!("input[{i}]: unsupported role {other:?}"))),
        };
        let content = crate::conv_items::content_text("input", i, item.get("content").unwrap_or(&Value::Null))?;
        out.push(ChatMessage::new(role, content));
    }
    if !out.iter().any(|m| m.role == "user") {
        return Err(refuse("input", "at least one user message is required"));
    }
    Ok(out)
}

fn opt_str(o: &Map<String, Value>, field: &'static str) -> Result<Option<String>, ApiError> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(refuse(field, "must be a string")),
    }
}

fn opt_f32(o: &Map<String, Value>, field: &'static str) -> Result<Option<f32>, ApiError> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(|f| Some(f as f32)).ok_or_else(|| refuse(field, "must be a number")),
    }
}

fn opt_bool(o: &Map<String, Value>, field: &'static str) -> Result<Option<bool>, ApiError> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(refuse(field, "must be true or false")),
    }
}

/// Parses and validates a body.
pub fn parse(body: &[u8], default_max_tokens: usize) -> Result<ResponseRequest, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    let Value::Object(o) = v else { return Err(ApiError::bad_request("the body must be a JSON object")) };
    for (k, v) in &o {
        let Some((field, rule)) = FIELDS.iter().find(|(f, _)| f == k) else {
            return Err(ApiError::bad_request(format!("{k}: unknown or unsupported field")));
        };
        if v.is_null() {
            continue;
        }
        match rule {
            Rule::Served => {}
            Rule::OnlyIf(ok, why) if !ok(v) => return Err(refuse(field, why)),
            Rule::OnlyIf(..) => {}
            Rule::Refused(why) => return Err(refuse(field, why)),
        }
    }
    let messages = parse_input(o.get("input").ok_or_else(|| refuse("input", "is required"))?)?;
    let previous_response_id = opt_str(&o, "previous_response_id")?;
    let conversation = match o.get("conversation") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(c)) => match c.get("id").and_then(Value::as_str) {
            Some(id) if c.len() == 1 => Some(id.to_string()),
            _ => return Err(refuse("conversation", "must be an ID or {\"id\": ID}")),
        },
        Some(_) => return Err(refuse("conversation", "must be an ID or {\"id\": ID}")),
    };
    if previous_response_id.is_some() && conversation.is_some() {
        return Err(refuse("previous_response_id", "previous_response_id and conversation cannot both be given"));
    }
    let max_output_tokens = match o.get("max_output_tokens") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=u32::MAX as u64).contains(&n) => Some(n as u32),
            _ => return Err(refuse("max_output_tokens", "must be a positive integer")),
        },
    };
    let truncation = opt_str(&o, "truncation")?.unwrap_or_else(|| "disabled".into());
    if !matches!(truncation.as_str(), "disabled" | "auto") {
        return Err(refuse("truncation", "must be \"auto\" or \"disabled\""));
    }
    opt_str(&o, "user")?;
    opt_str(&o, "safety_identifier")?;
    let sampling = SamplingParams {
        temperature: opt_f32(&o, "temperature")?.unwrap_or(1.0),
        top_p: opt_f32(&o, "top_p")?.unwrap_or(1.0),
        max_tokens: max_output_tokens.map(|n| n as usize).unwrap_or(default_max_tokens),
        ..SamplingParams::default()
    };
    let sampling = sampling.validate().map_err(|e| ApiError::bad_request(e.to_string()))?.into_inner();
    let mut canon = o.clone();
    canon.remove("stream");
    canon.remove("stream_options");
    let hash = Sha256::digest(Value::Object(canon).to_string().as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
    Ok(ResponseRequest {
        messages,
        instructions: opt_str(&o, "instructions")?,
        previous_response_id,
        conversation,
        sampling,
        max_output_tokens,
        store: opt_bool(&o, "store")?.unwrap_or(true),
        stream: opt_bool(&o, "stream")?.unwrap_or(false),
        metadata: crate::conv_common::parse_metadata("metadata", o.get("metadata"))?,
        truncation,
        hash,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> ApiError {
        parse(body.as_bytes(), 16).expect_err(body)
    }

    /// Every field Baton does not offer is a 400 that names it; the harmless values of
    /// the same fields are accepted.
    #[test]
    fn unsupported_fields_are_refused_by_name() {
        let cases: &[(&str, &str)] = &[
            (r#""tools":[{"type":"function","name":"f","parameters":{}}]"#, "tools"),
            (r#""tool_choice":"required""#, "tool_choice"),
            (r#""tool_choice":{"type":"function","name":"f"}"#, "tool_choice"),
            (r#""max_tool_calls":2"#, "max_tool_calls"),
            (r#""background":true"#, "background"),
            (r#""reasoning":{"effort":"high"}"#, "reasoning"),
            (r#""text":{"format":{"type":"json_schema","name":"x","schema":{}}}"#, "text"),
            (r#""text":{"format":{"type":"json_object"}}"#, "text"),
            (r#""include":["message.output_text.logprobs"]"#, "include"),
            (r#""top_logprobs":3"#, "top_logprobs"),
            (r#""prompt":{"id":"pmpt_1"}"#, "prompt"),
            (r#""prompt_cache_key":"k""#, "prompt_cache_key"),
            (r#""service_tier":"flex""#, "service_tier"),
            (r#""context_management":[{"type":"compaction"}]"#, "context_management"),
            (r#""truncation":"middle""#, "truncation"),
            (r#""metadata":{"k":1}"#, "metadata"),
            (r#""store":"yes""#, "store"),
        ];
        for (field_json, field) in cases {
            let e = err(&format!(r#"{{"input":"hi",{field_json}}}"#));
            assert_eq!(e.status, 400, "{field_json}");
            assert_eq!(e.param, Some(*field), "{field_json}: {}", e.message);
            assert!(e.message.contains(field), "{field_json}: {}", e.message);
        }
        // Unknown fields are named in the message.
        let e = err(r#"{"input":"hi","frobnicate":1}"#);
        assert!(e.message.contains("frobnicate"), "{}", e.message);
        // Inputs that are not text messages name the input.
        for input in [
            r#"[{"role":"user","content":[{"type":"input_image","image_url":"http://x/y.png"}]}]"#,
            r#"[{"role":"user","content":[{"type":"input_file","file_id":"f"}]}]"#,
            r#"[{"type":"function_call_output","call_id":"c","output":"x"}]"#,
            r#"[{"type":"item_reference","id":"msg_1"}]"#,
        ] {
            let e = err(&format!(r#"{{"input":{input}}}"#));
            assert_eq!(e.param, Some("input"), "{input}");
        }
        // The harmless values pass.
        let ok = parse(
            br#"{"input":"hi","tools":[],"tool_choice":"auto","parallel_tool_calls":true,"background":false,"reasoning":null,
                 "text":{"format":{"type":"text"}},"include":[],"top_logprobs":0,"service_tier":"auto","truncation":"auto",
                 "stream_options":{"include_obfuscation":false},"user":"u-1","model":"any"}"#,
            16,
        );
        assert!(ok.is_ok(), "{:?}", ok.err());
    }

    #[test]
    fn every_table_field_is_tested_or_served() {
        // A new field in the table must come with a case above (or be served).
        for (f, rule) in FIELDS {
            if let Rule::Refused(_) = rule {
                let body = serde_json::json!({"input": "hi", *f: {"x": 1}}).to_string();
                assert_eq!(err(&body).param, Some(*f));
            }
        }
    }

    #[test]
    fn parses_inputs_and_fields() {
        let r = parse(
            br#"{"input":[{"role":"developer","content":"be brief"},{"type":"message","role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_text","text":"b"}]}],
                 "instructions":"s","max_output_tokens":7,"temperature":0,"store":false,"stream":true,"metadata":{"k":"v"},
                 "conversation":{"id":"conv-1"}}"#,
            16,
        )
        .unwrap();
        assert_eq!(r.messages[0].role, "system");
        assert_eq!(r.messages[1].content, "ab");
        assert_eq!(r.sampling.max_tokens, 7);
        assert_eq!(r.conversation.as_deref(), Some("conv-1"));
        assert!(!r.store && r.stream);
        assert!(r.single_user_message().is_err());
        let s = parse(br#"{"input":"x"}"#, 16).unwrap();
        assert_eq!(s.single_user_message().unwrap(), "x");
        assert!(s.store && !s.stream);
        // The mode is not part of the idempotency hash; the content is.
        let a = parse(br#"{"input":"x","stream":true}"#, 16).unwrap();
        assert_eq!(a.hash, s.hash);
        assert_ne!(parse(br#"{"input":"y"}"#, 16).unwrap().hash, s.hash);
        assert_eq!(err(r#"{"input":"x","previous_response_id":"r","conversation":"c"}"#).param, Some("previous_response_id"));
        assert_eq!(err(r#"{"instructions":"x"}"#).param, Some("input"));
        assert_eq!(err(r#"{"input":[{"role":"assistant","content":"x"}]}"#).param, Some("input"));
    }
}
