//! The web chat page and the headers that confine it. The page is one static file with
//! one inline script and one inline style; its Content-Security-Policy allows exactly
//! those two (by SHA-256), requests to its own origin, and nothing else: no other
//! script, no image but `data:` (so a reply that slipped past the sanitizer still cannot
//! make the browser fetch an address), no plugin, no form target, and no framing
//! (`frame-ancestors 'none'` and `X-Frame-Options: DENY`, against clickjacking). The
//! browser must not guess types (`nosniff`) nor send the page's URL on (`no-referrer`).

use axum::http::header;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::sync::OnceLock;

/// The page.
pub const INDEX: &str = include_str!("web/index.html");

/// The text between `open` and the next `close` in the page (empty if none).
fn inline<'a>(page: &'a str, open: &str, close: &str) -> &'a str {
    page.split_once(open).and_then(|(_, rest)| rest.split_once(close)).map(|(body, _)| body).unwrap_or("")
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn sha256_source(text: &str) -> String {
    format!("'sha256-{}'", base64(&Sha256::digest(text.as_bytes())))
}

/// The page's Content-Security-Policy.
pub fn content_security_policy() -> &'static str {
    static CSP: OnceLock<String> = OnceLock::new();
    CSP.get_or_init(|| {
        let script = sha256_source(inline(INDEX, "<script>", "</script>"));
        let style = sha256_source(inline(INDEX, "<style>", "</style>"));
        format!(
            "default-src 'none'; script-src {script}; style-src {style}; connect-src 'self'; img-src data:; \
             base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        )
    })
}

/// `GET /`: the page with its confining headers.
pub async fn index() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, content_security_policy()),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        INDEX,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_and_hashes_match_known_values() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        // SHA-256 of "" as a CSP source.
        assert_eq!(sha256_source(""), "'sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU='");
    }

    #[test]
    fn the_policy_allows_the_pages_own_script_and_style_only() {
        let csp = content_security_policy();
        assert!(!inline(INDEX, "<script>", "</script>").is_empty() && !inline(INDEX, "<style>", "</style>").is_empty());
        assert_eq!(INDEX.matches("<script").count(), 1, "one inline script: a second would be refused by the policy");
        assert!(!csp.contains("unsafe-inline") && csp.contains("frame-ancestors 'none'") && csp.contains("default-src 'none'"));
    }
}
