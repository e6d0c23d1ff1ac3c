//! The reply sanitizer: markdown parsed with pulldown-cmark, incrementally on
//! the stream, so that no reply makes the client's renderer fetch or link an
//! address the operator did not allow (exfiltration by markdown).
//!
//! A reply is markdown that clients render as a whole, so the invariant is on
//! the concatenation of everything sent, whatever the chunking: parsed as one
//! document it holds no image and no link or reference definition outside the
//! [`LinkPolicy`], no raw HTML, and no bare URL to another host.
//!
//! [`StreamSanitizer`] keeps the source since the last top-level block
//! boundary (the window), parses it on every push and sends the sanitized
//! text up to the hold point: the start of the earliest construct that more
//! text could still change (an open `[` or `![`, a `<` with no `>` yet, an
//! unclosed code span, a link or definition that ends where the text ends,
//! a word that may still grow into a URL). Sanitizing copies the source byte
//! for byte except for what it must change, so the client sees the block
//! structure the gateway parsed:
//! - an image is removed unless its URL is allowed;
//! - a link to any other URL keeps its text and loses brackets and URL; an
//!   autolink or bare URL to another host becomes a code span (shown, never
//!   clickable);
//! - raw HTML (blocks, inline tags, comments) is removed;
//! - a link reference definition to any other URL is removed, so a reference
//!   that resolves later (the definition may follow the use) resolves only to
//!   an allowed URL;
//! - only http(s) URLs can be allowed (never `javascript:`, `data:`, ...);
//!   URLs are judged after entity and escape decoding;
//! - code spans and code blocks are left as they are: renderers show them as
//!   text, never as links or images.
//!
//! A second parse checks each piece before it is sent: the text already sent
//! since its own block boundary plus the piece must sanitize to itself. A
//! piece that fails (a construct the hold rules missed) is sent with its
//! punctuation escaped, or not at all.

use crate::checks::LinkPolicy;
use pulldown_cmark::{BrokenLink, CodeBlockKind, CowStr, Event, LinkType, Options, Parser, Tag};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// Most bytes the sanitizer holds back for one unresolved construct; past it
/// the held text is sent with its brackets escaped, so it stays text.
pub const MAX_HELD: usize = 2048;

/// The dialect: CommonMark plus what GitHub-flavoured renderers add, less
/// what would make the gateway see fewer links than some renderer. Math is
/// off: a renderer without math shows `$...$` as markdown, so the links in it
/// are judged as links. Footnotes are off: a footnote definition is a
/// container to GFM but paragraph text or a link reference definition to
/// CommonMark, and code, lists or HTML inside it read differently in each;
/// read as CommonMark, its `]:` is escaped as text, so GFM sees no footnote
/// either (footnote definitions reach the client as text).
fn options() -> Options {
    Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH | Options::ENABLE_TASKLISTS | Options::ENABLE_GFM
}

/// A source range replaced in the output.
#[derive(Debug)]
struct Edit {
    at: Range<usize>,
    with: String,
    /// False for cosmetic escapes (`]` before `(` or `:` in plain text) that
    /// only keep text from becoming a construct later.
    safety: bool,
}

impl Edit {
    fn remove(at: Range<usize>) -> Self {
        Edit { at, with: String::new(), safety: true }
    }
}

/// What one parse of a window found.
#[derive(Default)]
struct Plan {
    edits: Vec<Edit>,
    /// Source offset up to which the output is final.
    hold: usize,
    /// Start offsets of the top-level blocks.
    blocks: Vec<usize>,
    /// Allowed reference definitions: (label, destination, span start).
    defs: Vec<(String, String, usize)>,
    /// The fence character of a top-level fenced code block that is still
    /// open at the end of the window (see [`open_fence`]).
    open_fence: Option<u8>,
}

/// Parses `src` and plans its sanitized form. `known` resolves references to
/// allowed definitions sent in earlier windows. `flush`: no more text will
/// come, so nothing is held. `escape_all`: escape every bracket, `<` and
/// backtick of plain text (a held construct released by force). `fence`:
/// the shortest backtick fence of an inserted code span.
fn plan(src: &str, policy: &LinkPolicy, known: &HashMap<String, String>, flush: bool, escape_all: bool, fence: usize) -> Plan {
    let resolve = |l: BrokenLink<'_>| known.get(&l.reference.to_lowercase()).map(|d| (CowStr::from(d.clone()), CowStr::from("")));
    let iter = Parser::new_with_broken_link_callback(src, options(), Some(resolve)).into_offset_iter();
    let mut p = Plan { hold: src.len(), ..Plan::default() };
    let open_at_end = |end: usize| !flush && src[end..].trim().is_empty();
    for (label, def) in iter.reference_definitions().iter() {
        if open_at_end(def.span.end) {
            p.hold = p.hold.min(def.span.start);
        }
        if policy.allows(&def.dest) {
            p.defs.push((label.to_lowercase(), def.dest.to_string(), def.span.start));
        } else {
            // A blank line where the definition was keeps the next line from
            // joining what came before.
            let with = if src[def.span.clone()].ends_with('\n') { "\n" } else { "" };
            p.edits.push(Edit { at: def.span.clone(), with: with.into(), safety: true });
        }
    }
    let events: Vec<(Event<'_>, Range<usize>)> = iter.collect();

    let mut depth = 0usize;
    let mut run = TextRun::default();
    // Text of the leaf block that ends the window (its openers may still close).
    let mut leaf_start = 0usize;
    let mut open_leaf_text: Vec<Range<usize>> = Vec::new();
    // Inside an allowed link or image (up to this event index): its text is kept as is.
    let mut quiet_until = 0usize;
    // Inside any link or image: brackets there are balanced already.
    let mut in_link_until = 0usize;
    let mut code_blocks: Vec<Range<usize>> = Vec::new();
    let mut i = 0;
    while i < events.len() {
        let (ev, r) = (&events[i].0, events[i].1.clone());
        if !matches!(ev, Event::Text(_)) {
            run.finish(src, policy, flush, escape_all, fence, &mut p);
        }
        match ev {
            Event::Start(tag) => {
                if depth == 0 {
                    p.blocks.push(r.start);
                }
                if matches!(tag, Tag::Paragraph | Tag::Heading { .. } | Tag::TableCell | Tag::Item) {
                    leaf_start = r.start;
                    open_leaf_text.clear();
                }
                depth += 1;
            }
            Event::End(_) => depth = depth.saturating_sub(1),
            Event::Rule if depth == 0 => p.blocks.push(r.start),
            _ => {}
        }
        match ev {
            Event::Start(Tag::Image { dest_url, .. }) => {
                let end = matching_end(&events, i);
                if !flush && r.end >= src.len() {
                    p.hold = p.hold.min(r.start);
                }
                if !policy.allows(dest_url) {
                    p.edits.push(Edit::remove(r));
                    depth = depth.saturating_sub(1);
                    i = end + 1;
                    continue;
                }
                quiet_until = quiet_until.max(end);
                in_link_until = in_link_until.max(end);
            }
            Event::Start(Tag::Link { link_type, dest_url, .. }) => {
                let end = matching_end(&events, i);
                if !flush && r.end >= src.len() {
                    p.hold = p.hold.min(r.start);
                }
                in_link_until = in_link_until.max(end);
                if policy.allows(dest_url) {
                    quiet_until = quiet_until.max(end);
                } else if matches!(link_type, LinkType::Autolink | LinkType::Email) {
                    let text: String = events[i + 1..end].iter().filter_map(|(e, _)| if let Event::Text(t) = e { Some(&**t) } else { None }).collect();
                    p.edits.push(Edit { at: r, with: code_span(&text, fence), safety: true });
                    depth = depth.saturating_sub(1);
                    i = end + 1;
                    continue;
                } else if end == i + 1 {
                    p.edits.push(Edit::remove(r));
                } else {
                    // Keep the link text (its own images and URLs are judged
                    // as they come); drop the brackets and the destination.
                    let first = events[i + 1].1.start;
                    let last = events[i + 1..end].iter().map(|(_, r)| r.end).max().unwrap_or(first);
                    p.edits.push(Edit::remove(r.start..first.max(r.start)));
                    p.edits.push(Edit::remove(last.min(r.end)..r.end));
                }
            }
            Event::Start(Tag::HtmlBlock) => {
                let end = matching_end(&events, i);
                let at = r.start..events[end].1.end.max(r.end);
                if open_at_end(at.end) {
                    p.hold = p.hold.min(at.start);
                }
                p.edits.push(Edit { at, with: "\n".into(), safety: true });
                depth = depth.saturating_sub(1);
                i = end + 1;
                continue;
            }
            Event::Html(_) | Event::InlineHtml(_) => p.edits.push(Edit::remove(r)),
            Event::Start(Tag::CodeBlock(kind)) => {
                // Code is shown as text: nothing in it is a link.
                if depth == 1 && matches!(kind, CodeBlockKind::Fenced(_)) && r.end >= src.len() {
                    p.open_fence = open_fence(src, r.start);
                }
                code_blocks.push(r.clone());
                i = matching_end(&events, i);
                continue;
            }
            Event::Text(t) => {
                run.push(t, r.clone(), i < quiet_until);
                if i >= in_link_until && r.start >= leaf_start {
                    open_leaf_text.push(r);
                }
            }
            _ => {}
        }
        i += 1;
    }
    run.finish(src, policy, flush, escape_all, fence, &mut p);
    escape_footnote_definitions(src, &code_blocks, &mut p.edits);
    if !flush {
        hold_open_openers(src, &open_leaf_text, &mut p.hold);
    }

    p.edits.sort_by_key(|e| (e.at.start, e.at.end));
    // Overlaps are not expected; keep the first of any pair (the check of the
    // sent text catches what that would let through).
    let mut kept: Vec<Edit> = Vec::with_capacity(p.edits.len());
    for e in p.edits.drain(..) {
        if kept.last().is_none_or(|k| k.at.end <= e.at.start) {
            kept.push(e);
        }
    }
    p.edits = kept;
    // Never cut an edit in two.
    for e in p.edits.iter().rev() {
        if e.at.start < p.hold && p.hold < e.at.end {
            p.hold = e.at.start;
        }
    }
    p
}

/// The fence character (`` ` `` or `~`) of the fenced code block that starts
/// at `start` and runs to the end of `src`, if it is still open: its opening
/// line is complete and no later line starts, after blanks, with that
/// character. A closing fence would (so would some code lines; those are
/// merely not taken for open, which costs only speed).
fn open_fence(src: &str, start: usize) -> Option<u8> {
    let body = start + src[start..].find('\n')? + 1;
    let c = *src[start..].trim_start().as_bytes().first()?;
    ((c == b'`' || c == b'~') && !may_close_fence(&src[body..], c)).then_some(c)
}

/// True when a line of `text` starts, after blanks, with `c`: it is or may
/// grow into a fence that closes a block fenced with `c`.
fn may_close_fence(text: &str, c: u8) -> bool {
    text.split('\n').any(|line| line.trim_start().as_bytes().first() == Some(&c))
}

/// [`open_fence`] of the last top-level block of `text` read as `dialect`.
fn open_fence_in(text: &str, dialect: Options) -> Option<u8> {
    let (mut depth, mut fence) = (0usize, None);
    for (ev, r) in Parser::new_ext(text, dialect).into_offset_iter() {
        match ev {
            Event::Start(tag) => {
                if depth == 0 {
                    let fenced = matches!(tag, Tag::CodeBlock(CodeBlockKind::Fenced(_)));
                    fence = if fenced && r.end >= text.len() { open_fence(text, r.start) } else { None };
                }
                depth += 1;
            }
            Event::End(_) => depth = depth.saturating_sub(1),
            _ if depth == 0 => fence = None,
            _ => {}
        }
    }
    fence
}

/// Escapes the `]` of every line that GFM would read as a footnote
/// definition (`[^label]:`), outside code blocks: this parser reads such a
/// line as CommonMark does (see [`options`]), possibly inside a code span or
/// a paragraph, where GFM would start a new block there.
fn escape_footnote_definitions(src: &str, code_blocks: &[Range<usize>], edits: &mut Vec<Edit>) {
    let b = src.as_bytes();
    let line_starts = std::iter::once(0).chain(src.match_indices('\n').map(|(n, _)| n + 1));
    for line in line_starts {
        let start = line + src[line..].bytes().take_while(|c| matches!(c, b' ' | b'>' | b'\t')).count();
        if !src[start..].starts_with("[^") {
            continue;
        }
        let Some(close) = src[start..].find(']').map(|c| start + c) else { continue };
        let label_ok = !src[start + 2..close].contains(['\n', '[']);
        if label_ok && b.get(close + 1) == Some(&b':') && b[close - 1] != b'\\' && !code_blocks.iter().any(|c| c.contains(&close)) {
            edits.push(Edit { at: close..close + 1, with: "\\]".into(), safety: true });
        }
    }
}

/// Index of the `End` that closes the `Start` at `i`.
fn matching_end(events: &[(Event<'_>, Range<usize>)], i: usize) -> usize {
    let mut depth = 0usize;
    for (j, (e, _)) in events.iter().enumerate().skip(i) {
        match e {
            Event::Start(_) => depth += 1,
            Event::End(_) => {
                depth -= 1;
                if depth == 0 {
                    return j;
                }
            }
            _ => {}
        }
    }
    events.len().saturating_sub(1)
}

/// Plain-text characters of the last leaf block that more text could still
/// turn into a construct: an open `[`/`![`, a `]` right before the end or
/// before an unfinished `(`/`[`/`:`, a `<` with no `>` after it, a backtick
/// run (an unclosed code span may close).
fn hold_open_openers(src: &str, texts: &[Range<usize>], hold: &mut usize) {
    let mut openers: Vec<usize> = Vec::new();
    let b = src.as_bytes();
    for r in texts {
        for p in r.clone() {
            if p > 0 && b[p - 1] == b'\\' {
                continue;
            }
            match b[p] {
                b'[' => openers.push(if p > 0 && b[p - 1] == b'!' { p - 1 } else { p }),
                b']' => {
                    if let Some(o) = openers.pop() {
                        let after = &src[p + 1..];
                        let open = match after.as_bytes().first() {
                            None => true,
                            Some(b'(') => !after.contains(')'),
                            Some(b'[') => !after[1..].contains(']'),
                            Some(b':') => after[1..].trim().is_empty(),
                            _ => false,
                        };
                        if open {
                            *hold = (*hold).min(o);
                        }
                    }
                }
                b'<' => {
                    let next = b.get(p + 1).copied();
                    let tag_like = next.is_none_or(|n| n.is_ascii_alphabetic() || matches!(n, b'/' | b'!' | b'?'));
                    if tag_like && !src[p + 1..].contains('>') {
                        *hold = (*hold).min(p);
                    }
                }
                b'`' => *hold = (*hold).min(p),
                b'!' if p + 1 == src.len() => *hold = (*hold).min(p),
                _ => {}
            }
        }
    }
    if let Some(&o) = openers.first() {
        *hold = (*hold).min(o);
    }
}

/// Consecutive text events: what a renderer's linkifier sees as one string.
#[derive(Default)]
struct TextRun {
    text: String,
    /// (range in `text`, range in the source, the source spells the text as is).
    pieces: Vec<(Range<usize>, Range<usize>, bool)>,
    quiet: bool,
}

impl TextRun {
    fn push(&mut self, t: &str, src: Range<usize>, quiet: bool) {
        let at = self.text.len();
        self.text.push_str(t);
        let plain = src.len() == t.len();
        self.pieces.push((at..self.text.len(), src, plain));
        self.quiet = quiet;
    }

    /// Source offset of text offset `d` (a piece that is not plain maps as a whole).
    fn source_at(&self, d: usize, end: bool) -> usize {
        for (t, s, plain) in &self.pieces {
            if d >= t.start && (d < t.end || (end && d == t.end)) {
                return match (plain, end) {
                    (true, _) => s.start + (d - t.start),
                    (false, false) => s.start,
                    (false, true) => s.end,
                };
            }
        }
        self.pieces.last().map(|p| p.1.end).unwrap_or(0)
    }

    fn finish(&mut self, src: &str, policy: &LinkPolicy, flush: bool, escape_all: bool, fence: usize, p: &mut Plan) {
        if self.pieces.is_empty() {
            return;
        }
        let mut url_edits: Vec<Range<usize>> = Vec::new();
        if !self.quiet {
            for (t, urls) in bare_urls(&self.text) {
                if urls.iter().all(|u| policy.allows(u)) {
                    continue;
                }
                let mut s = self.source_at(t.start, false);
                let e = self.source_at(t.end, true);
                // Include an escaping backslash, or it would escape the code span's backtick.
                while s > 0 && src.as_bytes()[s - 1] == b'\\' {
                    s -= 1;
                }
                p.edits.push(Edit { at: s..e, with: code_span(&self.text[t], fence), safety: true });
                url_edits.push(s..e);
            }
        }
        let b = src.as_bytes();
        for (_, s, plain) in &self.pieces {
            if !plain || self.quiet {
                continue;
            }
            for i in s.clone() {
                if url_edits.iter().any(|u| u.contains(&i)) || (i > 0 && b[i - 1] == b'\\') {
                    continue;
                }
                let c = b[i];
                let escape = if escape_all {
                    matches!(c, b'[' | b']' | b'<' | b'`')
                } else {
                    c == b']' && matches!(b.get(i + 1), Some(b'(') | Some(b':'))
                };
                if escape {
                    p.edits.push(Edit { at: i..i + 1, with: format!("\\{}", c as char), safety: escape_all });
                }
            }
        }
        // The last word may still grow into a URL.
        let last = self.pieces.last().map(|p| p.1.end).unwrap_or(0);
        if !flush && last >= src.len() && !self.text.ends_with(char::is_whitespace) {
            let start = self.text.rfind(char::is_whitespace).map(|w| w + 1).unwrap_or(0);
            if could_become_url(&self.text[start..]) {
                p.hold = p.hold.min(self.source_at(start, false));
            }
        }
        *self = TextRun::default();
    }
}

/// URLs a linkifier (GitHub, markdown-it) would make clickable in plain
/// text: `http://`, `https://`, `ftp://` and `www.` up to the next space or
/// `<`. Each token comes with every URL to judge in it: one per scheme or
/// `www.` inside it (renderers differ on where a URL starts), trailing
/// punctuation trimmed, `www.` read as http.
fn bare_urls(text: &str) -> Vec<(Range<usize>, Vec<String>)> {
    const STARTS: [&str; 4] = ["http://", "https://", "ftp://", "www."];
    let lower = text.to_ascii_lowercase();
    let next_start = |from: usize, to: usize| STARTS.iter().filter_map(|p| lower[from..to].find(p).map(|i| from + i)).min();
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(start) = next_start(from, lower.len()) {
        // GitHub's extended autolinks end at whitespace or `<`.
        let end = text[start..].find(|c: char| c.is_whitespace() || c == '<').map(|e| start + e).unwrap_or(text.len());
        let mut urls = Vec::new();
        let mut at = start;
        while let Some(s) = next_start(at, end) {
            let token = text[s..end].trim_end_matches(['.', ',', ':', ';', '!', '?', ')', '\'', '"', '*', '_', '~']);
            urls.push(if lower[s..].starts_with("www.") { format!("http://{token}") } else { token.to_string() });
            at = s + 1;
        }
        found.push((start..end, urls));
        from = end.max(start + 1);
    }
    found
}

/// Whether a word at the end of the text may still grow into a URL (held
/// so that an allowed URL is not sent half-way, when its host would be cut).
/// A URL that starts inside a word already sent is still caught: its edit
/// begins before the sent point, and the rest of it is dropped.
fn could_become_url(word: &str) -> bool {
    let w = word.to_ascii_lowercase();
    w.contains(['&', '\\']) || ["http://", "https://", "ftp://", "www."].iter().any(|p| p.starts_with(&w) || w.contains(p))
}

/// The longest run of backticks in `text`.
fn longest_backtick_run(text: &str) -> usize {
    text.split(|c| c != '`').map(str::len).max().unwrap_or(0)
}

/// A refused URL as a code span: shown, never a link. Its fence, at least
/// `fence` backticks, is longer than any backtick run of the reply so far,
/// and its text loses its own backticks, so no literal backtick elsewhere can
/// pair with a fence or with the text and leave the URL outside, whatever
/// block structure a renderer sees.
fn code_span(text: &str, fence: usize) -> String {
    let fence = "`".repeat(fence.max(1));
    format!("{fence}{}{fence}", text.replace('`', ""))
}

/// The source `src[from..to]` with the edits inside it applied. An edit that
/// began before `from` (its start was sent already) is cut off: the rest of
/// it is dropped. An inserted code span never touches another backtick (the
/// runs would merge and pair differently): a space goes between. `before`:
/// what the output so far ends with.
fn render(src: &str, edits: &[Edit], from: usize, to: usize, before: Tail) -> String {
    let mut out = String::with_capacity(to.saturating_sub(from));
    let mut tail = before;
    let mut push = |out: &mut String, text: &str, span: bool| {
        if text.is_empty() {
            return;
        }
        let touching = text.starts_with('`') && (tail == Tail::Span || (span && tail == Tail::Backtick));
        if touching {
            out.push(' ');
        }
        out.push_str(text);
        tail = match (span, text.ends_with('`')) {
            (true, _) => Tail::Span,
            (false, true) => Tail::Backtick,
            (false, false) => Tail::Other,
        };
    };
    let mut pos = from;
    for e in edits {
        if e.at.start >= to {
            break;
        }
        // An insertion (empty range) at `pos` is still to do.
        if e.at.end <= pos && !(e.at.is_empty() && e.at.start == pos) {
            continue;
        }
        if e.at.start < pos {
            pos = e.at.end.min(to);
            continue;
        }
        push(&mut out, &src[pos..e.at.start], false);
        push(&mut out, &e.with, e.with.starts_with('`'));
        pos = e.at.end.min(to);
    }
    if pos < to {
        push(&mut out, &src[pos..to], false);
    }
    out
}

/// How the output so far ends, for [`render`].
#[derive(Clone, Copy, PartialEq, Debug)]
enum Tail {
    Other,
    /// A backtick of the reply's own text.
    Backtick,
    /// The closing fence of an inserted code span.
    Span,
}

/// Backslash before every ASCII punctuation character: plain text in any
/// CommonMark renderer.
fn escape_punctuation(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if c.is_ascii_punctuation() {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// True when `text`, read as plain CommonMark (no tables) or as GitHub-flavoured markdown
/// with footnotes, holds an image, raw HTML, a definition or a link the policy refuses,
/// or a bare URL to another host. The block structure of those readings can differ from
/// [`options`]'s (a table's rows are one paragraph to CommonMark, so a code span or an
/// HTML tag may span rows; a footnote definition is a container to GFM): a renderer of
/// either dialect must see nothing unsafe either, so the check of sent text asks all three.
fn unsafe_in_other_dialects(text: &str, policy: &LinkPolicy, defs: &HashMap<String, String>) -> bool {
    [Options::empty(), options() | Options::ENABLE_FOOTNOTES].into_iter().any(|o| unsafe_in(text, o, policy, defs))
}

fn unsafe_in(text: &str, dialect: Options, policy: &LinkPolicy, defs: &HashMap<String, String>) -> bool {
    let resolve = |l: BrokenLink<'_>| defs.get(&l.reference.to_lowercase()).map(|d| (CowStr::from(d.clone()), CowStr::from("")));
    let parser = Parser::new_with_broken_link_callback(text, dialect, Some(resolve));
    if parser.reference_definitions().iter().any(|(_, d)| !policy.allows(&d.dest)) {
        return true;
    }
    let (mut in_code, mut in_link) = (false, 0usize);
    let mut run = String::new();
    let bare = |run: &str| bare_urls(run).iter().flat_map(|(_, urls)| urls).any(|u| !policy.allows(u));
    for ev in parser {
        if !matches!(ev, Event::Text(_)) {
            if bare(&run) {
                return true;
            }
            run.clear();
        }
        match ev {
            Event::Start(Tag::CodeBlock(_)) => in_code = true,
            Event::End(pulldown_cmark::TagEnd::CodeBlock) => in_code = false,
            Event::Start(Tag::Image { dest_url, .. }) | Event::Start(Tag::Link { dest_url, .. }) => {
                if !policy.allows(&dest_url) {
                    return true;
                }
                in_link += 1;
            }
            Event::End(pulldown_cmark::TagEnd::Image | pulldown_cmark::TagEnd::Link) => in_link = in_link.saturating_sub(1),
            Event::Html(_) | Event::InlineHtml(_) => return true,
            Event::Text(t) if !in_code && in_link == 0 => run.push_str(&t),
            _ => {}
        }
    }
    bare(&run)
}

/// Sanitizes a whole document at once (tests, and the check of sent text).
pub fn sanitize(text: &str, policy: &LinkPolicy) -> String {
    let p = plan(text, policy, &HashMap::new(), true, false, longest_backtick_run(text) + 1);
    render(text, &p.edits, 0, text.len(), Tail::Other)
}

/// The start of the line of the largest top-level block start where the
/// window may be cut: the blocks before it are closed for good, since its
/// first line is complete. The line start, not the block start: an indented
/// code block starts after its indentation, which must stay in the window.
fn cut_point(text: &str, blocks: &[usize], limit: usize) -> Option<usize> {
    blocks
        .iter()
        .rev()
        .map(|&b| text[..b].rfind('\n').map(|n| n + 1).unwrap_or(0))
        .find(|&line| line > 0 && line <= limit && text[line..].contains('\n'))
}

/// The sanitizer of one streamed reply.
pub struct StreamSanitizer {
    policy: Arc<LinkPolicy>,
    /// Source since the last block boundary, and how much of it was sent.
    src: String,
    done: usize,
    /// Allowed definitions of earlier windows, by lowercase label.
    defs: HashMap<String, String>,
    /// Sent text since its own last block boundary, and its definitions.
    sent: String,
    sent_defs: HashMap<String, String>,
    /// Longest backtick run of the reply so far (see [`code_span`]).
    backticks: usize,
    /// How the sent text ends (see [`render`]).
    tail: Tail,
    /// Set while both the window and the sent text end inside the same open
    /// top-level fenced code block, in every dialect the check reads (its
    /// fence character): then text with no line that may close it is code
    /// and is sent as it comes, unparsed. Without this, one long code block
    /// was parsed whole on every push (quadratic in its length).
    in_code: Option<u8>,
    /// Full parses of the window (for the tests).
    parses: usize,
}

impl StreamSanitizer {
    pub fn new(policy: Arc<LinkPolicy>) -> Self {
        StreamSanitizer {
            policy,
            src: String::new(),
            done: 0,
            defs: HashMap::new(),
            sent: String::new(),
            sent_defs: HashMap::new(),
            backticks: 0,
            tail: Tail::Other,
            in_code: None,
            parses: 0,
        }
    }

    /// Feeds generated text; returns what may be sent now (maybe nothing).
    pub fn push(&mut self, chunk: &str) -> String {
        let before = self.src.len();
        self.src.push_str(chunk);
        // A run may span chunks: measure it over the window's tail.
        let tail = self.src.len().saturating_sub(chunk.len() + self.backticks + 1);
        let tail = (tail..self.src.len()).find(|&i| self.src.is_char_boundary(i)).unwrap_or(self.src.len());
        self.backticks = self.backticks.max(longest_backtick_run(&self.src[tail..]));
        if let Some(c) = self.in_code {
            // The lines the chunk touched: the one it continues, and its own.
            let line = self.src[..before].rfind('\n').map_or(0, |n| n + 1);
            if !may_close_fence(&self.src[line..], c) {
                return self.code();
            }
        }
        self.step(false)
    }

    /// Inside an open code block (see `in_code`): the new text as it is, which
    /// is what [`Self::step`] would send and the check would pass.
    fn code(&mut self) -> String {
        let piece = render(&self.src, &[], self.done, self.src.len(), self.tail);
        self.note_tail(&piece, false);
        self.done = self.src.len();
        self.sent.push_str(&piece);
        piece
    }

    /// How the output ends after `piece` (`span_end`: with an inserted code span).
    fn note_tail(&mut self, piece: &str, span_end: bool) {
        if !piece.is_empty() {
            self.tail = match (span_end, piece.ends_with('`')) {
                (true, _) => Tail::Span,
                (false, true) => Tail::Backtick,
                (false, false) => Tail::Other,
            };
        }
    }

    /// End of the reply: returns the rest.
    pub fn finish(&mut self) -> String {
        self.step(true)
    }

    /// Bytes held back.
    pub fn held(&self) -> usize {
        self.src.len() - self.done
    }

    fn step(&mut self, flush: bool) -> String {
        self.in_code = None;
        self.parses += 1;
        let fence = self.backticks + 1;
        let mut p = plan(&self.src, &self.policy, &self.defs, flush, false, fence);
        let mut hold = p.hold.max(self.done);
        if !flush && self.src.len() - hold > MAX_HELD {
            p = plan(&self.src, &self.policy, &self.defs, true, true, fence);
            hold = self.src.len();
        }
        let piece = render(&self.src, &p.edits, self.done, hold, self.tail);
        let span_end = p.edits.iter().any(|e| e.at.end == hold && e.with.starts_with('`') && e.at.start >= self.done);
        self.note_tail(&piece, span_end);
        self.done = hold;
        let window_in_code = if flush || hold < self.src.len() { None } else { p.open_fence };
        if let Some(cut) = cut_point(&self.src, &p.blocks, self.done) {
            for (label, dest, start) in &p.defs {
                if *start < cut {
                    self.defs.entry(label.clone()).or_insert_with(|| dest.clone());
                }
            }
            self.src.drain(..cut);
            self.done -= cut;
        }
        // Inside code, the piece must also reach the client unchanged.
        let unchanged = window_in_code.map(|_| piece.clone());
        let sent = self.send(piece);
        if unchanged.is_some_and(|p| p == sent) && self.sent_in_code() == window_in_code {
            self.in_code = window_in_code;
        }
        sent
    }

    /// The fence of the open top-level code block the sent text ends in, when
    /// every dialect the check reads agrees on it.
    fn sent_in_code(&self) -> Option<u8> {
        let ours = open_fence_in(&self.sent, options());
        let others = [Options::empty(), options() | Options::ENABLE_FOOTNOTES].map(|o| open_fence_in(&self.sent, o));
        ours.filter(|c| others.iter().all(|o| o == &Some(*c)))
    }

    /// Checks a piece against what was sent before it; see the module docs.
    fn send(&mut self, piece: String) -> String {
        if piece.is_empty() {
            return piece;
        }
        let mut out = piece;
        let mut checked = None;
        for attempt in 0..2 {
            let candidate = format!("{}{}", self.sent, out);
            let p = plan(&candidate, &self.policy, &self.sent_defs, true, false, self.backticks + 1);
            if p.edits.iter().all(|e| !e.safety) && !unsafe_in_other_dialects(&candidate, &self.policy, &self.sent_defs) {
                checked = Some((candidate, p));
                break;
            }
            if attempt == 0 {
                tracing::debug!("a reply piece failed the markdown check; sending it escaped");
                out = escape_punctuation(&out);
            }
        }
        let Some((candidate, p)) = checked else {
            tracing::warn!("a reply piece failed the markdown check twice; dropped");
            return String::new();
        };
        self.sent = candidate;
        // Cut the sent text only after a blank line: a block start of this reading that
        // follows a blank line starts a block in the other dialects too, so no construct of
        // theirs (a paragraph's code span or comment) spans the cut.
        let after_blank: Vec<usize> = p.blocks.iter().copied().filter(|&b| self.sent[..b].trim_end_matches([' ', '\t']).ends_with("\n\n")).collect();
        if let Some(cut) = cut_point(&self.sent, &after_blank, self.sent.len()) {
            for (label, dest, start) in &p.defs {
                if *start < cut {
                    self.sent_defs.entry(label.clone()).or_insert_with(|| dest.clone());
                }
            }
            self.sent.drain(..cut);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sanitizer() -> StreamSanitizer {
        StreamSanitizer::new(Arc::new(LinkPolicy { allowed_hosts: vec!["docs.rs".into()] }))
    }

    #[test]
    fn holds_back_only_the_open_construct() {
        let mut s = sanitizer();
        assert_eq!(s.push("Hello there [do"), "Hello there ");
        assert_eq!(s.held(), 3);
        assert_eq!(s.push("c](https://docs.rs/x) and "), "[doc](https://docs.rs/x) and ");
        assert_eq!(s.push("![a](https://evil.com/?q=1"), "");
        assert_eq!(s.push(") done."), " done.");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn a_definition_after_its_use_is_removed_in_a_later_window() {
        let mut s = sanitizer();
        let mut out = s.push("See ![a][r] and [b][r].\n\nMore text.\n\n");
        assert!(s.src.len() < 20, "closed blocks leave the window: {:?}", s.src);
        out += &s.push("[r]: https://evil.com/?q=secret\n");
        out += &s.finish();
        assert!(!out.contains("evil"), "{out:?}");
        assert!(out.starts_with("See ![a][r] and [b][r]."), "{out:?}");
    }

    #[test]
    fn an_allowed_definition_resolves_in_later_windows() {
        let mut s = sanitizer();
        let mut out = s.push("[d]: https://docs.rs/x\n\nFirst.\n\n");
        out += &s.push("Read [the docs][d] now.\n");
        out += &s.finish();
        assert_eq!(out, "[d]: https://docs.rs/x\n\nFirst.\n\nRead [the docs][d] now.\n");
    }

    #[test]
    fn a_held_construct_past_the_limit_is_released_as_text() {
        let mut s = sanitizer();
        let long = "x".repeat(MAX_HELD + 10);
        let out = s.push(&format!("[{long}"));
        assert!(out.starts_with("\\[x"), "released escaped: {:?}", &out[..8]);
        let rest = s.push("](https://evil.com/?q=1) end") + &s.finish();
        assert_eq!(rest, " end");
    }

    /// Streams `text` in chunks of `n` characters.
    fn streamed(s: &mut StreamSanitizer, text: &str, n: usize) -> String {
        let chars: Vec<char> = text.chars().collect();
        let mut out: String = chars.chunks(n).map(|c| s.push(&c.iter().collect::<String>())).collect();
        out += &s.finish();
        out
    }

    #[test]
    fn a_long_code_block_streams_without_parsing_the_window_again() {
        let line = "let u = \"[x](https://evil.com/in-code)\"; // ![i](https://evil.com/i.png)\n";
        let text = format!("Here:\n\n```rust\n{}```\n\nSee [it](https://evil.com/?q=1) and ![i](https://evil.com/i.png).\n", line.repeat(400));
        let mut s = sanitizer();
        let out = streamed(&mut s, &text, 3);
        assert_eq!(out, sanitize(&text, &s.policy), "streamed as the whole document sanitizes");
        assert!(out.contains(&line.repeat(400)), "code is sent as it is");
        assert!(out.ends_with("See it and .\n"), "{:?}", &out[out.len() - 40..]);
        // About 10,000 chunks; the window is parsed for the lines before the
        // block, its first line, and after its closing fence, not per chunk.
        let chunks = text.chars().count().div_ceil(3);
        assert!(s.parses < 60, "{} parses for {chunks} chunks", s.parses);
    }

    #[test]
    fn a_code_line_that_may_close_the_fence_is_parsed() {
        // `~~~` closes nothing in a backtick block; "``" may still grow into a fence.
        let text = "```\na\n~~~\n``\n```\n[x](https://evil.com/) b\n";
        for n in 1..5 {
            let mut s = sanitizer();
            assert_eq!(streamed(&mut s, text, n), "```\na\n~~~\n``\n```\nx b\n", "chunks of {n}");
        }
    }

    #[test]
    fn code_streams_unparsed_only_where_the_client_sees_code_too() {
        // The window holds an open code block, but the client got its fence
        // escaped (as if the check had refused it): what follows is not code
        // to the client, so it must still be checked.
        let mut s = sanitizer();
        s.src = "```\n".into();
        s.done = 4;
        s.sent = "\\`\\`\\`\n".into();
        assert_eq!(s.push("code\n"), "code\n");
        assert_eq!(s.in_code, None, "the client's text has no open code block");
        let out = s.push("[x](https://evil.com/?q=1)\n");
        assert!(!out.contains("[x](https"), "sent as a link: {out:?}");
    }

    #[test]
    fn a_piece_that_fails_the_check_of_sent_text_is_escaped() {
        let mut s = sanitizer();
        // Sent text that ends in an open tag's prefix (as if a hold rule had missed it).
        s.sent = "a <img src=\"x".into();
        assert_eq!(s.send("\">".into()), "\\\"\\>");
    }

    #[test]
    fn policy_refuses_every_scheme_but_http_and_odd_authorities() {
        let p = LinkPolicy { allowed_hosts: vec!["docs.rs".into()] };
        for ok in ["https://docs.rs", "http://DOCS.RS/x?y#z", "https://a.docs.rs:443/x", "https://docs.rs./"] {
            assert!(p.allows(ok), "{ok}");
        }
        for bad in [
            "javascript:alert(1)",
            "data:image/png;base64,AA",
            "//docs.rs/x",
            "https://docs.rs@evil.com/",
            "https://docs.rs\\@evil.com/",
            "https://docs.rs%2eevil.com/",
            "https://evildocs.rs/",
            "https://docs.rs.evil.com/",
            "https://dоcs.rs/",
            "https:docs.rs",
            "https://docs.rs:x/",
        ] {
            assert!(!p.allows(bad), "{bad}");
        }
    }
}
