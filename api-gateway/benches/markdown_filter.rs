//! Throughput of the reply filter's markdown part: the pattern filter the
//! gateway used before (kept here, verbatim, as the baseline) against the
//! pulldown-cmark sanitizer, on a realistic reply streamed in token-sized
//! chunks. Prints MB/s and microseconds per chunk side by side.
//!
//! `cargo bench -p baton-api-gateway --bench markdown_filter` (BENCH_REPLIES
//! sets how many replies each filter streams). On the shared 2-core
//! development machine (release build): pattern filter 0.035 us and 113 MB/s,
//! sanitizer 5.9 us and 0.7 MB/s per 4-character chunk of a 2.7 kB reply;
//! both a small fraction of a token's generation time. Then one long code
//! block against the same lines as paragraphs, at 100, 400 and 1,600 lines.

use baton_api_gateway::checks::LinkPolicy;
use baton_api_gateway::markdown::StreamSanitizer;
use std::sync::Arc;
use std::time::Instant;

/// The old filter: strips `![..](..)`, keeps `[..](..)` to allowed hosts.
mod baseline {
    /// Hosts whose links are kept (the old check).
    #[derive(Clone, Debug, Default)]
    pub struct LinkPolicy {
        pub allowed_hosts: Vec<String>,
    }

    impl LinkPolicy {
        fn allows(&self, url: &str) -> bool {
            let url = url.trim();
            let rest = match url.strip_prefix("https://").or_else(|| url.strip_prefix("http://")) {
                Some(r) => r,
                None => return false,
            };
            let host_port = rest.split(['/', '?', '#']).next().unwrap_or("");
            if host_port.contains('@') {
                return false;
            }
            let host = host_port.split(':').next().unwrap_or("").to_lowercase();
            self.allowed_hosts.iter().any(|a| {
                let a = a.to_lowercase();
                host == a || host.ends_with(&format!(".{a}"))
            })
        }
    }

    /// Most bytes a markdown construct may span before it is let through as text.
    const MAX_HELD: usize = 2048;

    /// The old streaming filter's markdown part.
    pub struct PatternFilter {
        links: LinkPolicy,
        pending: String,
    }

    impl PatternFilter {
        pub fn new(links: LinkPolicy) -> Self {
            PatternFilter { links, pending: String::new() }
        }

        pub fn push(&mut self, chunk: &str) -> String {
            self.pending.push_str(chunk);
            self.sanitize(false)
        }

        pub fn finish(&mut self) -> String {
            self.sanitize(true)
        }

        /// Moves complete text from `pending` to the output, rewriting markdown
        /// images and links; keeps an incomplete construct pending.
        fn sanitize(&mut self, flush: bool) -> String {
            let mut out = String::new();
            loop {
                let Some(start) = self.pending.find(['!', '[']) else {
                    out.push_str(&self.pending);
                    self.pending.clear();
                    return out;
                };
                out.push_str(&self.pending[..start]);
                self.pending.drain(..start);
                match parse_construct(&self.pending) {
                    Construct::Incomplete if !flush && self.pending.len() < MAX_HELD => return out,
                    Construct::Incomplete | Construct::NotOne => {
                        let c = self.pending.chars().next().map(char::len_utf8).unwrap_or(1);
                        out.push_str(&self.pending[..c]);
                        self.pending.drain(..c);
                    }
                    Construct::Image { len } => {
                        self.pending.drain(..len);
                    }
                    Construct::Link { len, text_end, url } => {
                        if self.links.allows(&self.pending[url.clone()]) {
                            out.push_str(&self.pending[..len]);
                        } else {
                            out.push_str(&self.pending[1..text_end]);
                        }
                        self.pending.drain(..len);
                    }
                }
            }
        }
    }

    enum Construct {
        Incomplete,
        NotOne,
        Image { len: usize },
        Link { len: usize, text_end: usize, url: std::ops::Range<usize> },
    }

    /// `s` starts with `!` or `[`.
    fn parse_construct(s: &str) -> Construct {
        let image = s.starts_with('!');
        let open = if image { 1 } else { 0 };
        if image {
            match s.as_bytes().get(1) {
                None => return Construct::Incomplete,
                Some(b'[') => {}
                Some(_) => return Construct::NotOne,
            }
        }
        let body = &s[open + 1..];
        let Some(close) = body.find([']', '\n']) else { return Construct::Incomplete };
        if body.as_bytes()[close] == b'\n' {
            return Construct::NotOne;
        }
        let text_end = open + 1 + close;
        match s.as_bytes().get(text_end + 1) {
            None => return Construct::Incomplete,
            Some(b'(') => {}
            Some(_) => return Construct::NotOne,
        }
        let url_start = text_end + 2;
        let Some(rel) = s[url_start..].find([')', '\n']) else { return Construct::Incomplete };
        if s.as_bytes()[url_start + rel] == b'\n' {
            return Construct::NotOne;
        }
        let len = url_start + rel + 1;
        if image {
            Construct::Image { len }
        } else {
            let url_text = &s[url_start..url_start + rel];
            let url_len = url_text.find(' ').unwrap_or(url_text.len());
            Construct::Link { len, text_end, url: url_start..url_start + url_len }
        }
    }
}

/// A reply of the kind a chat model writes: prose, a list, links (allowed
/// and not), inline code, a fenced code block, a table and one image.
fn reply() -> String {
    let para = "Rivers shape the land they cross: they carve valleys, carry silt and build deltas where they meet the sea. \
                See [the survey](https://docs.rs/survey) or [this blog](https://blog.example.net/rivers?id=42) for details, \
                and note that `x[i] = y` is how the model indexes arrays. Some **bold** text and an interval [0, 1).\n\n";
    let list = "1. First, measure the flow.\n2. Then, compare it with [the table](https://docs.rs/table).\n3. Finally, plot it.\n\n";
    let code = "```rust\nfn main() {\n    let v = vec![1, 2, 3];\n    println!(\"{:?}\", v);\n}\n```\n\n";
    let table = "| river | length |\n|---|---|\n| Nile | 6650 km |\n| Amazon | 6400 km |\n\n";
    let image = "![a map](https://tiles.example.net/map.png)\n\n";
    let mut s = String::new();
    for _ in 0..4 {
        s.push_str(para);
        s.push_str(list);
        s.push_str(code);
        s.push_str(table);
    }
    s.push_str(image);
    s.push_str(para);
    s
}

/// Token-sized chunks: about four characters, cut on character boundaries.
fn chunks(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(4).map(|c| c.iter().collect()).collect()
}

fn measure(name: &str, replies: usize, bytes: usize, chunks: usize, mut run: impl FnMut() -> usize) -> f64 {
    let mut sink = run(); // warm-up
    let started = Instant::now();
    for _ in 0..replies {
        sink += run();
    }
    let secs = started.elapsed().as_secs_f64();
    let mb_s = (bytes * replies) as f64 / secs / 1e6;
    let us_chunk = secs * 1e6 / (chunks * replies) as f64;
    println!("{name:<28} {mb_s:>10.1} MB/s {us_chunk:>10.3} us/chunk   (checksum {sink})");
    us_chunk
}

fn main() {
    let replies: usize = std::env::var("BENCH_REPLIES").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let text = reply();
    let pieces = chunks(&text);
    println!("reply: {} bytes in {} chunks; {replies} replies per filter", text.len(), pieces.len());
    let hosts = vec!["docs.rs".to_string()];
    let old = measure("pattern filter (before)", replies, text.len(), pieces.len(), || {
        let mut f = baseline::PatternFilter::new(baseline::LinkPolicy { allowed_hosts: hosts.clone() });
        pieces.iter().map(|p| f.push(p).len()).sum::<usize>() + f.finish().len()
    });
    let policy = Arc::new(LinkPolicy { allowed_hosts: hosts.clone() });
    let new = measure("pulldown-cmark sanitizer", replies, text.len(), pieces.len(), || {
        let mut f = StreamSanitizer::new(policy.clone());
        pieces.iter().map(|p| f.push(p).len()).sum::<usize>() + f.finish().len()
    });
    println!("the sanitizer costs {:.1}x the pattern filter per chunk", new / old);

    // One long code block against the same lines as paragraphs (each closes
    // the window): the cost per chunk should not grow with the block.
    let line = "    let total = items.iter().map(|x| x.len()).sum::<usize>();\n";
    for lines in [100usize, 400, 1600] {
        let code = format!("```rust\n{}```\n", line.repeat(lines));
        let paras = line.trim_start().repeat(lines).replace('\n', "\n\n");
        for (name, text) in [("code block", &code), ("paragraphs", &paras)] {
            let pieces = chunks(text);
            let replies = (replies / 20).max(2);
            measure(&format!("{name}, {lines} lines"), replies, text.len(), pieces.len(), || {
                let mut f = StreamSanitizer::new(policy.clone());
                pieces.iter().map(|p| f.push(p).len()).sum::<usize>() + f.finish().len()
            });
        }
    }
}
