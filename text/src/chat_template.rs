//! The model's own chat template (Jinja), rendered with minijinja the way
//! Hugging Face `transformers` renders it.
//!
//! Owns: turning a list of chat messages into the prompt text.
//!
//! Invariants (HF `apply_chat_template` compatibility, checked against
//! transformers' `utils/chat_template_utils.py`):
//! - `trim_blocks` and `lstrip_blocks` are on, a trailing newline is dropped;
//! - the context holds `messages`, `add_generation_prompt`, `bos_token` and
//!   `eos_token` (the token texts, `""` when the model has none);
//! - `raise_exception(msg)` fails the render with [`TemplateError::Raised`]
//!   carrying the template's message (a client error, not an engine fault);
//! - `tojson` is Python's `json.dumps(x, ensure_ascii=False)` (no HTML
//!   escaping, `", "`/`": "` separators), and `strftime_now(fmt)` formats the
//!   current UTC time;
//! - the Python `str`/`dict` methods templates use (`.strip()`,
//!   `.startswith()`, `.split()`, `.items()`, `.get()`, ...) are provided by
//!   an unknown-method callback (a subset of minijinja-contrib's pycompat);
//!   they and the `trim` filter use Python's whitespace (`str.isspace`, which
//!   also has U+001C..U+001F), as Jinja2 does;
//! - a model without a template loads; rendering then fails with
//!   [`TemplateError::Missing`], so a chat request gets a clear error.
//!
//! The template is parsed once at construction; a syntax error is reported
//! then, not at the first request.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::{Deserialize, Serialize};

use crate::gguf::{GgufError, GgufFile};

const TEMPLATE_NAME: &str = "chat";

/// Errors of chat template parsing and rendering.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("chat template does not parse: {source}")]
    Syntax {
        #[source]
        source: minijinja::Error,
    },
    #[error("chat template failed to render: {source}")]
    Render {
        #[source]
        source: minijinja::Error,
    },
    /// The template itself rejected the conversation (`raise_exception`).
    #[error("chat template rejected the messages: {message}")]
    Raised { message: String },
    /// The model carries no chat template (GGUF `tokenizer.chat_template`).
    #[error("this model has no chat template (GGUF key tokenizer.chat_template), so it cannot take chat messages; send a raw prompt instead")]
    Missing,
}

impl TemplateError {
    /// A stable, short name of the variant, for metric labels and API errors.
    pub fn label(&self) -> &'static str {
        match self {
            TemplateError::Gguf(e) => e.label(),
            TemplateError::Syntax { .. } => "template_syntax",
            TemplateError::Render { .. } => "template_render",
            TemplateError::Raised { .. } => "template_raised",
            TemplateError::Missing => "template_missing",
        }
    }
}

/// One chat message, as in the OpenAI/HF message list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"`, or whatever else the template knows.
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A parsed chat template with the model's BOS/EOS texts.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `None`: the model has no template and every render fails.
    source: Option<String>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.as_ref().map(String::len))
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// The error `raise_exception` attaches, found again when mapping errors.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

impl ChatTemplate {
    /// The template in `tokenizer.chat_template`, with BOS/EOS texts from
    /// the token list; without that key, a template whose every render is
    /// [`TemplateError::Missing`].
    pub fn from_gguf(f: &GgufFile) -> Result<Self, TemplateError> {
        if f.get("tokenizer.chat_template").is_none() {
            return Ok(ChatTemplate {
                env: Environment::new(),
                source: None,
                bos_token: String::new(),
                eos_token: String::new(),
            });
        }
        let source = f.get_str("tokenizer.chat_template")?;
        let tokens = f.get_str_array("tokenizer.ggml.tokens")?;
        let text = |key: &str| -> String {
            f.opt_u32(key)
                .and_then(|id| tokens.get(id as usize))
                .map(|s| s.to_string())
                .unwrap_or_default()
        };
        let (bos, eos) = (
            text("tokenizer.ggml.bos_token_id"),
            text("tokenizer.ggml.eos_token_id"),
        );
        Self::from_str(source, &bos, &eos)
    }

    /// Parses `template`; `bos_token`/`eos_token` are the texts the template sees.
    #[allow(clippy::should_implement_trait)]
    pub fn from_str(
        template: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("trim", pycompat::trim);
        env.set_unknown_method_callback(pycompat::call_method);
        env.add_template_owned(TEMPLATE_NAME, template.to_string())
            .map_err(|source| TemplateError::Syntax { source })?;
        Ok(ChatTemplate {
            env,
            source: Some(template.to_string()),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template source (`""` when the model has none).
    pub fn source(&self) -> &str {
        self.source.as_deref().unwrap_or_default()
    }

    /// Whether the model has a template (else every render is [`TemplateError::Missing`]).
    pub fn is_present(&self) -> bool {
        self.source.is_some()
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where
    /// the assistant's reply starts.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        if self.source.is_none() {
            return Err(TemplateError::Missing);
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|source| TemplateError::Syntax { source })?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        tmpl.render(ctx).map_err(map_render_error)
    }
}

fn map_render_error(e: Error) -> TemplateError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<Raised>() {
            return TemplateError::Raised {
                message: r.0.clone(),
            };
        }
        cur = err.source();
    }
    TemplateError::Render { source: e }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// `strftime_now(fmt)`: the current UTC time, formatted.
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(&format, secs)))
}

/// A small `strftime` over a UNIX time (UTC): `%Y %y %m %d %e %H %I %M %S %p
/// %j %a %A %b %B %%`; other directives are kept as written.
fn strftime(format: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (h, mi, s) = (sod / 3600, (sod % 3600) / 60, sod % 60);
    // Howard Hinnant's days_from_civil inverse.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let doy = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", if h % 12 == 0 { 12 } else { h % 12 })),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{doy:03}")),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`.
fn tojson(value: Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent.or(kwargs.get::<Option<Value>>("indent")?) {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(seps) if seps.len() == 2 => (seps[0].clone(), seps[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    kwargs.assert_all_used()?;
    let opts = JsonOpts {
        indent,
        ensure_ascii,
        sort_keys,
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    write_json(&mut out, &value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    indent: Option<String>,
    ensure_ascii: bool,
    sort_keys: bool,
    item_sep: String,
    key_sep: String,
}

fn write_json(out: &mut String, v: &Value, o: &JsonOpts, level: usize) -> Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    out.push_str(&v.to_string());
                }
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                match k.as_str() {
                    Some(s) => write_json_str(out, s, o.ensure_ascii),
                    None => write_json_str(out, &k.to_string(), o.ensure_ascii),
                }
                out.push_str(&o.key_sep);
                write_json(out, &v.get_item(k)?, o, level + 1)?;
            }
            newline(out, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                write_json(out, item, o, level + 1)?;
            }
            newline(out, level);
            out.push(']');
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {other}"),
            ))
        }
    }
    Ok(())
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `str` and `dict` methods for templates written against Jinja2.
mod pycompat;

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str) -> String {
        ChatTemplate::from_str(src, "<s>", "</s>")
            .unwrap()
            .render(&[ChatMessage::user(" Hi ")], true)
            .unwrap()
    }

    #[test]
    fn python_string_methods() {
        assert_eq!(
            render("{{ messages[0].content.strip() }}|{{ messages[0].content.lstrip() }}|"),
            "Hi|Hi |"
        );
        assert_eq!(
            render("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }}"),
            "True True"
        );
        assert_eq!(render("{{ 'a b  c'.split() | length }} {{ 'a,b'.split(',')[1] }} {{ 'hello world'.title() }}"), "3 b Hello World");
        assert_eq!(render("{{ 'xxhixx'.strip('x') }} {{ 'aaa'.replace('a', 'b', 2) }} {{ '-'.join(['a', 'b']) }}"), "hi bba a-b");
        assert_eq!(render("{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %} {{ {'a': 1}.get('b', 2) }}"), "a=1 2");
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        assert_eq!(
            render(r#"{{ {"a": [1, 2.5, true, none], "b": "Donne l'année <n>"} | tojson }}"#),
            r#"{"a": [1, 2.5, true, null], "b": "Donne l'année <n>"}"#
        );
        assert_eq!(
            render(r#"{{ [1, {"a": "b"}] | tojson(indent=2) }}"#),
            "[\n  1,\n  {\n    \"a\": \"b\"\n  }\n]"
        );
        assert_eq!(
            render(r#"{{ "é\n" | tojson(ensure_ascii=true) }}"#),
            r#""\u00e9\n""#
        );
    }

    #[test]
    fn raise_exception_is_its_own_error() {
        let t = ChatTemplate::from_str("{% if messages[0].role != 'system' %}{{ raise_exception('need a system message') }}{% endif %}", "", "")
            .unwrap();
        let e = t.render(&[ChatMessage::user("x")], false).unwrap_err();
        assert!(
            matches!(&e, TemplateError::Raised { message } if message == "need a system message"),
            "{e}"
        );
        assert_eq!(e.label(), "template_raised");
    }

    #[test]
    fn template_is_shareable_across_threads() {
        fn is<T: Send + Sync>() {}
        is::<ChatTemplate>();
    }

    #[test]
    fn syntax_error_at_construction() {
        let e = ChatTemplate::from_str("{% for m in messages %}", "", "").unwrap_err();
        assert_eq!(e.label(), "template_syntax");
    }

    #[test]
    fn strftime_known_dates() {
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %b %j", 0),
            "1970-01-01 00:00:00 Thu Jan 001"
        );
        assert_eq!(
            strftime("%d %B %Y %A", 1_709_164_800),
            "29 February 2024 Thursday"
        );
        assert_eq!(
            strftime("%y %I%p %% %Q", 951_782_400 + 13 * 3600),
            "00 01PM % %Q"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_like_hf() {
        let src = "{% for m in messages %}\n    {{ m.role }}\n{% endfor %}\n";
        let t = ChatTemplate::from_str(src, "", "").unwrap();
        assert_eq!(
            t.render(
                &[ChatMessage::user("a"), ChatMessage::assistant("b")],
                false
            )
            .unwrap(),
            "    user\n    assistant\n"
        );
    }
}
