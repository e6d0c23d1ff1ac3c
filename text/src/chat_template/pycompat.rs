//! Python `str` and `dict` methods for templates written against Jinja2
//! (`.strip()`, `.startswith()`, `.split()`, `.items()`, `.get()`, ...), called through
//! minijinja's unknown-method callback, and the `trim` filter with Python's whitespace.

use super::*;

fn arg_str<'a>(args: &'a [Value], i: usize, method: &str) -> Result<Option<&'a str>, Error> {
    match args.get(i) {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidOperation,
                format!("{method}: argument {} must be a string", i + 1),
            )
        }),
    }
}

fn arg_int(args: &[Value], i: usize) -> Option<i64> {
    args.get(i).and_then(Value::as_i64)
}

fn too_many(args: &[Value], max: usize, method: &str) -> Result<(), Error> {
    if args.len() > max {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            format!("{method} takes at most {max} arguments"),
        ));
    }
    Ok(())
}

/// Prefixes for `startswith`/`endswith`: a string or a tuple/list of strings.
fn affixes(args: &[Value], method: &str) -> Result<Vec<String>, Error> {
    too_many(args, 1, method)?;
    let Some(v) = args.first() else {
        return Err(Error::new(
            ErrorKind::MissingArgument,
            format!("{method} needs an argument"),
        ));
    };
    if let Some(s) = v.as_str() {
        return Ok(vec![s.to_string()]);
    }
    v.try_iter()?
        .map(|x| {
            x.as_str().map(str::to_string).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{method}: prefixes must be strings"),
                )
            })
        })
        .collect()
}

/// Python's `str.isspace` for one character: Unicode White_Space plus
/// the four information separators U+001C..U+001F.
pub(super) fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Jinja2's `trim` filter: Python `str.strip(chars)`.
pub(super) fn trim(s: String, chars: Option<String>) -> String {
    strip_with(&s, chars.as_deref(), true, true).to_string()
}

fn strip_with<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let pred = |c: char| match chars {
        Some(set) => set.contains(c),
        None => py_isspace(c),
    };
    let s = if left { s.trim_start_matches(pred) } else { s };
    if right {
        s.trim_end_matches(pred)
    } else {
        s
    }
}

fn split(s: &str, sep: Option<&str>, maxsplit: Option<i64>) -> Result<Vec<Value>, Error> {
    let limit = maxsplit.filter(|&m| m >= 0).map(|m| m as usize);
    Ok(match sep {
        Some("") => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "split: empty separator",
            ))
        }
        Some(sep) => match limit {
            Some(m) => s.splitn(m + 1, sep).map(Value::from).collect(),
            None => s.split(sep).map(Value::from).collect(),
        },
        None => {
            let mut parts = Vec::new();
            let mut rest = s.trim_start_matches(py_isspace);
            while !rest.is_empty() {
                if limit.is_some_and(|m| parts.len() >= m) {
                    parts.push(Value::from(rest));
                    break;
                }
                let end = rest.find(py_isspace).unwrap_or(rest.len());
                parts.push(Value::from(&rest[..end]));
                rest = rest[end..].trim_start_matches(py_isspace);
            }
            parts
        }
    })
}

fn title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_cased = false;
    for c in s.chars() {
        if prev_cased {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        prev_cased = c.is_alphabetic();
    }
    out
}

fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    Ok(match method {
        "strip" | "lstrip" | "rstrip" => {
            too_many(args, 1, method)?;
            let chars = arg_str(args, 0, method)?;
            Value::from(strip_with(s, chars, method != "rstrip", method != "lstrip"))
        }
        "startswith" => Value::from(
            affixes(args, method)?
                .iter()
                .any(|p| s.starts_with(p.as_str())),
        ),
        "endswith" => Value::from(
            affixes(args, method)?
                .iter()
                .any(|p| s.ends_with(p.as_str())),
        ),
        "upper" => Value::from(s.to_uppercase()),
        "lower" => Value::from(s.to_lowercase()),
        "title" => Value::from(title(s)),
        "capitalize" => {
            let mut c = s.chars();
            Value::from(match c.next() {
                Some(first) => first
                    .to_uppercase()
                    .chain(c.flat_map(char::to_lowercase))
                    .collect::<String>(),
                None => String::new(),
            })
        }
        "replace" => {
            too_many(args, 3, method)?;
            let (Some(old), Some(new)) = (arg_str(args, 0, method)?, arg_str(args, 1, method)?)
            else {
                return Err(Error::new(
                    ErrorKind::MissingArgument,
                    "replace needs old and new",
                ));
            };
            match arg_int(args, 2).filter(|&n| n >= 0) {
                Some(n) => Value::from(s.replacen(old, new, n as usize)),
                None => Value::from(s.replace(old, new)),
            }
        }
        "split" => {
            too_many(args, 2, method)?;
            Value::from(split(s, arg_str(args, 0, method)?, arg_int(args, 1))?)
        }
        "splitlines" => Value::from(s.lines().map(Value::from).collect::<Vec<_>>()),
        "find" => {
            let sub = arg_str(args, 0, method)?.unwrap_or_default();
            Value::from(s.find(sub).map_or(-1, |b| s[..b].chars().count() as i64))
        }
        "count" => {
            let sub = arg_str(args, 0, method)?.unwrap_or_default();
            Value::from(if sub.is_empty() {
                s.chars().count() + 1
            } else {
                s.matches(sub).count()
            })
        }
        "join" => {
            let items = args
                .first()
                .ok_or_else(|| {
                    Error::new(ErrorKind::MissingArgument, "join needs an iterable")
                })?
                .try_iter()?
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| v.to_string())
                })
                .collect::<Vec<_>>();
            Value::from(items.join(s))
        }
        "isdigit" => Value::from(!s.is_empty() && s.chars().all(|c| c.is_ascii_digit())),
        "isalpha" => Value::from(!s.is_empty() && s.chars().all(char::is_alphabetic)),
        "isalnum" => Value::from(!s.is_empty() && s.chars().all(char::is_alphanumeric)),
        "isspace" => Value::from(!s.is_empty() && s.chars().all(py_isspace)),
        "islower" => {
            Value::from(s.chars().any(char::is_lowercase) && !s.chars().any(char::is_uppercase))
        }
        "isupper" => {
            Value::from(s.chars().any(char::is_uppercase) && !s.chars().any(char::is_lowercase))
        }
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

fn map_method(
    state: &State,
    map: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    match method {
        "items" => {
            too_many(args, 0, method)?;
            state.apply_filter("items", std::slice::from_ref(map))
        }
        "keys" => {
            too_many(args, 0, method)?;
            Ok(Value::from(map.try_iter()?.collect::<Vec<_>>()))
        }
        "values" => {
            too_many(args, 0, method)?;
            let vals = map
                .try_iter()?
                .map(|k| map.get_item(&k))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Value::from(vals))
        }
        "get" => {
            too_many(args, 2, method)?;
            let key = args
                .first()
                .ok_or_else(|| Error::new(ErrorKind::MissingArgument, "get needs a key"))?;
            let v = map.get_item(key)?;
            Ok(if v.is_undefined() {
                args.get(1).cloned().unwrap_or(Value::from(()))
            } else {
                v
            })
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

/// The environment's unknown-method callback.
pub(super) fn call_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::String => string_method(value.as_str().unwrap_or_default(), method, args),
        ValueKind::Map => map_method(state, value, method, args),
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}
