//! Request parameters both APIs read the same way: `stop` (one string or a list, as in
//! the OpenAI API) and the operator's ceiling on `max_tokens`. They live here rather than
//! in either handler module, so that `conversations` need not import `openai`.

use crate::error::ApiError;
use serde::Deserialize;

#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings, however the body spelled them.
    pub fn into_strings(stop: Option<Stop>) -> Vec<String> {
        match stop {
            None => vec![],
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        }
    }
}

/// The operator's ceiling on one reply's length (`--max-tokens-ceiling`): a clear 400 above it.
pub fn check_max_tokens(max_tokens: usize, ceiling: usize) -> Result<(), ApiError> {
    if max_tokens > ceiling {
        return Err(ApiError::bad_param("max_tokens", format!("max_tokens is {max_tokens}; this server allows at most {ceiling}")));
    }
    Ok(())
}
