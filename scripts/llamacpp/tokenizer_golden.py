#!/usr/bin/env python3
"""Token IDs from llama.cpp for every text of the tokenizer corpus, for both
tokenizer kinds Baton has: SmolLM2's byte-level BPE and Gemma 3's
SentencePiece. Writes engine/tests/golden/tokenizer_llamacpp.json, which
engine/tests/tokenizer_corpus.rs compares against.

Run with the venv that scripts/llamacpp/build.sh creates:

    .cache/llamacpp/venv/bin/python scripts/llamacpp/tokenizer_golden.py

Models come from scripts/fetch-model.sh (default and `gemma3`), or
--smollm2 PATH / --gemma3 PATH. Per model and text:
  * special   llama_tokenize(text, add_special=False, parse_special=True)
  * plain     the same with parse_special=False, only where it differs
  * decoded   llama_detokenize(special, remove_special=False,
              unparse_special=True), only where it is not the text itself
And Gemma 3's chat template (engine/tests/golden/gemma3_chat_template.jinja;
the GGUF we serve has none) rendered by Jinja2 as HF transformers does, with
llama.cpp's tokens of each rendering and llama.cpp's built-in Gemma format.
"""

import argparse
import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys

import llama_cpp
from llama_cpp import Llama

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GOLDEN = os.path.join(ROOT, "engine", "tests", "golden")
sys.path.insert(0, os.path.dirname(__file__))
from golden import builtin_template_render, llama_cpp_commit, make_renderer, sha256_file  # noqa: E402

CHAT_CASES = [
    ("user_only", True, [{"role": "user", "content": "Hi there!"}]),
    ("system_and_user", True, [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"}]),
    ("multi_turn", True, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! 👋"},
        {"role": "user", "content": "Count: 1, 2, 3?"}]),
    ("no_generation_prompt", False, [
        {"role": "user", "content": "Give me a synonym for happy."},
        {"role": "assistant", "content": "Joyful."}]),
    ("trimmed_content", True, [
        {"role": "system", "content": "  keep my spaces  "},
        {"role": "user", "content": "  \n Hello \t\n"},
        {"role": "assistant", "content": "\u001f\u001c python whitespace \u001d\u00a0"},
        {"role": "user", "content": "\u3000ideographic space\u2028"}]),
    ("unicode_and_markup", True, [
        {"role": "user", "content": "日本語、Ελληνικά, עברית 🇫🇷 — {{ 1 + 1 }} {% if %} <b>bold</b>"}]),
    ("code", True, [
        {"role": "user", "content": "def f(x):\n    return x * 2\n\nprint(f(21))"}]),
    ("other_role", True, [{"role": "developer", "content": "a custom role"}]),
    ("system_only", True, [{"role": "system", "content": "Only a system message."}]),
    ("roles_not_alternating", True, [
        {"role": "user", "content": "one"}, {"role": "user", "content": "two"}]),
    ("assistant_first", True, [{"role": "assistant", "content": "I start."}]),
]


def chat_cases(gemma_path, template):
    """Gemma 3's template rendered by Jinja2 (HF's environment), tokenized by llama.cpp."""
    llm = Llama(model_path=gemma_path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    render = make_renderer(template)
    out = []
    for name, gen, msgs in CHAT_CASES:
        case = {"name": name, "add_generation_prompt": gen, "messages": msgs}
        try:
            text = render.render(messages=msgs, add_generation_prompt=gen,
                                 bos_token="<bos>", eos_token="<eos>")
            case["jinja2"] = text
            case["tokens"] = tokenize(vocab, text.encode("utf-8"), True)
        except Exception as e:  # raise_exception in the template
            case["error"] = str(e)
        if gen:
            case["llama_cpp_builtin"] = builtin_template_render(llm, template, msgs)
        out.append(case)
    return out


def fetched(kind):
    args = ["bash", os.path.join(ROOT, "scripts", "fetch-model.sh")] + ([kind] if kind else [])
    out = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True).stdout
    return out.strip().splitlines()[-1]


def tokenize(vocab, data, parse_special):
    n_max = len(data) + 16
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, False, parse_special)
    if n < 0:
        raise RuntimeError(f"token buffer too small for {data!r}")
    return list(buf[:n])


def detokenize(vocab, ids):
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, True)
    if n < 0:
        raise RuntimeError("detokenize buffer too small")
    return buf.raw[:n]


def model_cases(path, texts):
    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    md = llm.metadata
    out = {
        "file": os.path.basename(path),
        "sha256": sha256_file(path),
        "tokenizer_model": md.get("tokenizer.ggml.model"),
        "n_vocab": llm.n_vocab(),
        "special": [],
        "plain": {},
        "decoded": {},
    }
    for i, t in enumerate(texts):
        data = t.encode("utf-8")
        special = tokenize(vocab, data, True)
        plain = tokenize(vocab, data, False)
        out["special"].append(special)
        if plain != special:
            out["plain"][str(i)] = plain
        back = detokenize(vocab, special)
        if back != data:
            out["decoded"][str(i)] = back.decode("utf-8", errors="replace")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", default=None)
    ap.add_argument("--gemma3", default=None)
    ap.add_argument("--corpus", default=os.path.join(GOLDEN, "tokenizer_corpus.json"))
    ap.add_argument("--out", default=os.path.join(GOLDEN, "tokenizer_llamacpp.json"))
    args = ap.parse_args()
    with open(args.corpus, encoding="utf-8") as f:
        texts = json.load(f)
    models = {
        "smollm2": args.smollm2 or fetched(None),
        "gemma3": args.gemma3 or fetched("gemma3"),
    }
    doc = {
        "format": {
            "texts": "the corpus (tokenizer_corpus.json), in order",
            "special": "llama_tokenize(text, add_special=False, parse_special=True), per text",
            "plain": "text index -> llama_tokenize(..., parse_special=False), only where it differs from special",
            "decoded": "text index -> llama_detokenize(special, remove_special=False, unparse_special=True), "
                       "only where it is not the text (invalid UTF-8 replaced by U+FFFD)",
        },
        "generator": "scripts/llamacpp/tokenizer_golden.py",
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp_commit": llama_cpp_commit(),
        "texts": texts,
        "models": {name: model_cases(path, texts) for name, path in models.items()},
    }
    with open(os.path.join(GOLDEN, "gemma3_chat_template.jinja"), encoding="utf-8") as f:
        template = f.read()
    doc["gemma3_chat"] = chat_cases(models["gemma3"], template)
    with open(args.out, "w", encoding="utf-8") as f:
        # Indented, with each list of IDs on one line: diffable and small.
        text = json.dumps(doc, ensure_ascii=False, indent=1)
        text = re.sub(r"\[(\s*\d+(?:,\s*\d+)*\s*)\]",
                      lambda m: "[" + "".join(m.group(1).split()) + "]", text)
        f.write(text)
        f.write("\n")
    for name, m in doc["models"].items():
        n = sum(len(x) for x in m["special"])
        print(f"{name}: {len(texts)} texts, {n} tokens, {len(m['plain'])} differ without "
              f"parse_special, {len(m['decoded'])} do not decode to themselves")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
