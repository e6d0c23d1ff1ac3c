#!/usr/bin/env python3
"""Golden greedy continuations from llama.cpp (via llama-cpp-python) on the models beyond
the default one: Gemma 3 270M Q4_K_M and SmolLM2 requantized to Q4_K_M and Q6_K
(scripts/llamacpp/requantize.sh). Checked by engine/tests/golden_llamacpp.rs.

    .cache/llamacpp/venv/bin/python scripts/llamacpp/golden_models.py [--only NAME] [--model NAME=PATH]

Writes engine/tests/golden/llamacpp_<NAME>.json per model. Full-vocabulary logits are not
stored (Gemma's 262k vocabulary would make each case a megabyte); instead, per greedy step,
llama.cpp's top-5 token IDs with their log-probabilities (log-softmax over the whole
vocabulary, in f64) and the top1-top2 logit margin, which is what the test compares.

Per case (18 chat cases, 7 languages, short, about 600 tokens, and 700-1,400 tokens, past
Gemma's 512-token sliding window):
  * prompt_text / prompt_tokens  as golden.py: the chat template rendered with jinja2 and
                    llama.cpp's tokenization of it (add_bos=False, special=True). Gemma's
                    GGUF has no template; Google's, committed beside the goldens, is used.
  * greedy_tokens   N_GREEDY argmax steps over llama.cpp's logits (no sampler, no EOS stop)
  * greedy_top5     per step [[id, logprob] x 5] of the logits that chose the token
  * greedy_logits_top2_margin  per step, top1 - top2 logit
  * f32_kv_top5_logprob_max_abs_diff  llama.cpp against itself: the same tokens teacher-
                    forced with f32 instead of f16 KV; the largest change of those top-5
                    log-probabilities over the case (the noise floor the tolerance is set
                    against; see the README, "How correctness is checked")
"""

import argparse
import json
import os
import re
import sys

import numpy as np

import llama_cpp
from llama_cpp import Llama

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from golden import (PY_SNIPPET, RUST_SNIPPET, SUPPORT_POLICY, ROOT,  # noqa: E402
                    llama_cpp_commit, make_renderer, sha256_file)

N_GREEDY = 32
N_CTX = 2048
GOLDEN_DIR = os.path.join(ROOT, "engine", "tests", "golden")
GEMMA_TEMPLATE = "gemma3_chat_template.jinja"
GGML_TYPE_F32 = 0


def model_cache_dir():
    """As scripts/fetch-model.sh: BATON_MODEL_CACHE, XDG_CACHE_HOME/baton/models or ~/.cache/baton/models."""
    if os.environ.get("BATON_MODEL_CACHE"):
        return os.environ["BATON_MODEL_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "baton", "models")


# name -> (default file in the model cache, env var that overrides it, template file or None)
MODELS = {
    "gemma3_q4_k_m": ("gemma-3-270m-q4_k_m.gguf", "BATON_GEMMA_MODEL", GEMMA_TEMPLATE),
    "smollm2_q4_k_m": ("SmolLM2-135M-Instruct.Q4_K_M.gguf", None, None),
    "smollm2_q6_k": ("SmolLM2-135M-Instruct.Q6_K.gguf", None, None),
}

# ---------------------------------------------------------------------------
# Texts for the long cases (written for these goldens; no meaning beyond being varied)
# ---------------------------------------------------------------------------

FRENCH_ARTICLE = """Le métro de Paris a été inauguré le 19 juillet 1900, pendant l'Exposition universelle. La première ligne reliait la porte de Vincennes à la porte Maillot et transportait déjà plusieurs dizaines de milliers de voyageurs par jour. L'ingénieur Fulgence Bienvenüe, surnommé le « père du métro », a dirigé les travaux pendant plus de trente ans, tandis que l'architecte Hector Guimard dessinait les célèbres entrées en fonte verte, inspirées des formes végétales de l'Art nouveau.

Au cours du vingtième siècle, le réseau s'est étendu vers la banlieue. Les lignes ont été prolongées, de nouvelles stations ont été ouvertes et le matériel roulant a été modernisé à plusieurs reprises. Dans les années 1950, la RATP a expérimenté les roulements sur pneumatiques, qui permettent des accélérations plus fortes et un roulement plus silencieux. La ligne 11 a été la première à en bénéficier, suivie par les lignes 1, 4, 6 et 14.

La ligne 14, ouverte en 1998 sous le nom de Météor, est entièrement automatique : aucun conducteur n'est présent à bord et les trains se succèdent toutes les quatre-vingt-cinq secondes aux heures de pointe. Son succès a conduit à l'automatisation de la ligne 1, achevée en 2012 sans interrompre le service, ce qui constituait une première mondiale pour une ligne aussi fréquentée.

Aujourd'hui, le métro compte plus de trois cents stations et transporte environ quatre millions de voyageurs par jour. Le projet du Grand Paris Express prévoit d'ajouter quatre nouvelles lignes automatiques autour de la capitale, afin de relier les banlieues entre elles sans passer par le centre. Les travaux, commencés en 2015, mobilisent des dizaines de tunneliers et devraient s'achever au début des années 2030.

Malgré son âge, le réseau reste un symbole de la ville. Les touristes photographient les entrées Guimard, les musiciens jouent dans les couloirs et les Parisiens se plaignent, comme toujours, de la chaleur en été et des retards aux heures de pointe."""

GERMAN_TEXT = """Immer mehr Städte in Deutschland bauen ihre Radwege aus. In Münster, das oft als Fahrradhauptstadt bezeichnet wird, werden fast vierzig Prozent aller Wege mit dem Rad zurückgelegt. Die Stadt hat breite Radwege, eigene Ampeln für Radfahrer und ein großes Fahrradparkhaus am Hauptbahnhof, in dem mehr als dreitausend Räder Platz finden.

Andere Städte ziehen nach. Berlin hat ein Mobilitätsgesetz beschlossen, das geschützte Radstreifen an allen Hauptstraßen vorsieht. Kritiker bemängeln jedoch, dass die Umsetzung zu langsam vorangeht: Von den geplanten Kilometern ist bisher nur ein kleiner Teil fertig. Die Verwaltung verweist auf lange Planungsverfahren, fehlendes Personal und Konflikte mit dem Lieferverkehr.

Auch das Lastenrad gewinnt an Bedeutung. Familien transportieren damit Kinder und Einkäufe, Handwerker ihre Werkzeuge und Kurierdienste Pakete in der Innenstadt. Viele Gemeinden fördern den Kauf mit Zuschüssen von mehreren hundert Euro."""

SPANISH_TEXT = """Para preparar una tortilla de patatas para cuatro personas se necesitan seis huevos, cuatro patatas medianas, una cebolla, aceite de oliva y sal. Primero se pelan las patatas y se cortan en láminas finas; la cebolla se corta en juliana. Después se fríen a fuego medio en abundante aceite durante unos veinte minutos, hasta que estén tiernas pero no doradas.

Mientras tanto, se baten los huevos con una pizca de sal en un cuenco grande. Cuando las patatas y la cebolla están listas, se escurren bien y se mezclan con el huevo batido. Conviene dejar reposar la mezcla unos minutos para que las patatas absorban el huevo.

Se calienta una sartén con un poco de aceite, se vierte la mezcla y se cuaja a fuego medio. Con ayuda de un plato se le da la vuelta y se cuaja por el otro lado. Hay quien la prefiere poco hecha, jugosa por dentro, y quien la quiere bien cuajada: es uno de los debates más antiguos de la cocina española."""

JAPANESE_TEXT = """京都は七九四年から千年以上にわたって日本の都でした。市内には千を超える寺院と数百の神社があり、その多くが世界遺産に登録されています。金閣寺は池に映る金色の姿で知られ、清水寺は崖の上に張り出した木造の舞台で有名です。春には桜、秋には紅葉を見るために、国内外から多くの観光客が訪れます。

一方で、観光客の増加は地元の住民にとって課題にもなっています。バスが混雑して通勤や通学に使えないことがあり、祇園では私有地での撮影が問題になりました。市は観光客向けの急行バスを導入し、混雑の少ない時間帯や地域を案内するなどの対策を進めています。"""

CHINESE_TEXT = """长城是中国古代的军事防御工程，修建的历史可以追溯到两千多年前的春秋战国时期。秦始皇统一六国以后，把各国原有的城墙连接起来，形成了最早的万里长城。现在我们看到的长城大多是明朝修建的，东起山海关，西到嘉峪关，全长六千多公里。长城不仅是一项伟大的建筑工程，也是中华民族的象征。每年都有数以百万计的游客来到八达岭、慕田峪等地参观。"""

CODE_LONG = """```python
import csv
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class Sale:
    region: str
    product: str
    units: int
    price: float

    @property
    def revenue(self) -> float:
        return self.units * self.price


def read_sales(path: str) -> list[Sale]:
    with open(path, newline="") as f:
        return [Sale(r["region"], r["product"], int(r["units"]), float(r["price"]))
                for r in csv.DictReader(f)]


def revenue_by_region(sales: list[Sale]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for s in sales:
        totals[s.region] += s.revenue
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def best_product(sales: list[Sale], region: str) -> str | None:
    best, best_units = None, -1
    for s in sales:
        if s.region == region and s.units > best_units:
            best, best_units = s.product, s.units
    return best
```

```rust
#[derive(Debug, Clone, PartialEq)]
pub enum Token { Num(f64), Op(char), LParen, RParen }

pub fn tokenize(src: &str) -> Result<Vec<Token>, String> {
    let mut out = Vec::new();
    let mut chars = src.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            ' ' => { chars.next(); }
            '0'..='9' | '.' => {
                let mut s = String::new();
                while let Some(&d) = chars.peek() {
                    if d.is_ascii_digit() || d == '.' { s.push(d); chars.next(); } else { break; }
                }
                out.push(Token::Num(s.parse().map_err(|e| format!("{s}: {e}"))?));
            }
            '+' | '-' | '*' | '/' => { out.push(Token::Op(c)); chars.next(); }
            '(' => { out.push(Token::LParen); chars.next(); }
            ')' => { out.push(Token::RParen); chars.next(); }
            other => return Err(format!("unexpected character {other:?}")),
        }
    }
    Ok(out)
}
```"""

SUPPORT_CONVERSATION = [
    {"role": "user", "content": "Hi, my internet has been down since this morning and the router light is orange."},
    {"role": "assistant", "content": "I'm sorry to hear that. Let's fix it together.\n1. Please unplug the router for 30 seconds.\n2. Plug it back in and wait two minutes.\nDid the light turn green? Is there anything else I can help with?"},
    {"role": "user", "content": "I did that, it's still orange. My account number is 4471-229 and the postal code is 90210."},
    {"role": "assistant", "content": "Thank you, your account is verified. I am checking the outage map for your area. There is no known outage near 90210 right now. Since the restart did not help, I can book a technician visit. Is there anything else I can help with?"},
    {"role": "user", "content": "How much does the technician cost? I signed up eight months ago."},
    {"role": "assistant", "content": "Good news: visits are free within the first 12 months of service, so this one costs nothing. Would you like me to book it? Is there anything else I can help with?"},
    {"role": "user", "content": "Yes please, tomorrow morning if possible. Also, I was without internet for two days last month, can I get some money back? And what is the price of Gigabit?"},
]

# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

CASES = [
    # short, one per language
    {"name": "short_english", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]},
    {"name": "short_french", "messages": [
        {"role": "user", "content": "Quelle est la capitale de l'Allemagne ? Réponds en une phrase."}]},
    {"name": "short_german", "messages": [
        {"role": "user", "content": "Erkläre in zwei Sätzen, warum der Himmel blau ist."}]},
    {"name": "short_spanish", "messages": [
        {"role": "system", "content": "Eres un asistente amable."},
        {"role": "user", "content": "¿Cuántos días tiene un año bisiesto y por qué?"}]},
    {"name": "short_chinese", "messages": [
        {"role": "user", "content": "请用一句话介绍一下长城。"}]},
    {"name": "short_japanese", "messages": [
        {"role": "user", "content": "日本の首都はどこですか？一文で答えてください。"}]},
    {"name": "short_russian", "messages": [
        {"role": "user", "content": "Сколько будет семь умножить на восемь? Объясни кратко."}]},
    {"name": "multi_turn_english", "messages": [
        {"role": "system", "content": "You are a concise cooking assistant."},
        {"role": "user", "content": "I want to bake bread. What flour should I use?"},
        {"role": "assistant", "content": "Use bread flour: its higher protein content gives a chewier crumb."},
        {"role": "user", "content": "How long should I knead the dough?"},
        {"role": "assistant", "content": "About 10 minutes by hand, until it is smooth and springs back when poked."},
        {"role": "user", "content": "And at what temperature do I bake it?"}]},
    {"name": "code_python", "messages": [
        {"role": "system", "content": "You are an expert Python reviewer."},
        {"role": "user", "content": "What does this code print?\n\n```python\n" + PY_SNIPPET + "```"}]},
    {"name": "code_rust", "messages": [
        {"role": "user", "content": "Explain this Rust program:\n```rust\n" + RUST_SNIPPET + "```\nIs it idiomatic?"}]},
    {"name": "numbers_and_emoji", "messages": [
        {"role": "user", "content": "My order #000123 cost $1,299.99 on 2024-03-15 🎉 and shipping was €12.50. "
                                    "What was the total in dollars if 1 € = 1.08 $? 👍"}]},
    # about 600 tokens
    {"name": "policy_600_english", "messages": [
        {"role": "system", "content": SUPPORT_POLICY},
        {"role": "user", "content": "Hi, my internet has been down since this morning and the router light is orange. What should I do?"}]},
    {"name": "article_600_french", "messages": [
        {"role": "user", "content": "Lis cet article et résume-le en trois phrases.\n\n" + FRENCH_ARTICLE}]},
    # longer than Gemma's 512-token window
    {"name": "policy_conversation_long_english", "messages": [
        {"role": "system", "content": SUPPORT_POLICY}] + SUPPORT_CONVERSATION},
    {"name": "german_spanish_long", "messages": [
        {"role": "system", "content": "Du bist ein mehrsprachiger Assistent. Antworte auf Deutsch."},
        {"role": "user", "content": "Hier sind zwei Texte.\n\n" + GERMAN_TEXT + "\n\n" + SPANISH_TEXT
                                    + "\n\nWorum geht es im zweiten Text, und welche Zutaten braucht man?"}]},
    {"name": "french_article_then_question_long", "messages": [
        {"role": "user", "content": "Voici un article.\n\n" + FRENCH_ARTICLE},
        {"role": "assistant", "content": "Merci, j'ai lu l'article sur le métro de Paris. Que voulez-vous savoir ?"},
        {"role": "user", "content": "Voici un deuxième texte, en allemand.\n\n" + GERMAN_TEXT
                                    + "\n\nEn quelle année la ligne 14 a-t-elle ouvert, et quelle ville allemande est "
                                    "appelée la capitale du vélo ?"}]},
    {"name": "japanese_chinese_long", "messages": [
        {"role": "system", "content": "あなたは旅行案内のアシスタントです。"},
        {"role": "user", "content": JAPANESE_TEXT + "\n\n" + CHINESE_TEXT + "\n\n" + FRENCH_ARTICLE[:900]
                                    + "\n\n京都と長城について、それぞれ一文で説明してください。"}]},
    {"name": "code_long", "messages": [
        {"role": "system", "content": "You are a senior engineer doing code review."},
        {"role": "user", "content": "Review these two snippets. List one bug or weakness in each.\n\n" + CODE_LONG}]},
]


# ---------------------------------------------------------------------------
# llama.cpp
# ---------------------------------------------------------------------------

def last_logits(llm):
    """Logits of the last token of the last eval (the context keeps only that row: logits_all=False)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).astype(np.float64)


def log_softmax(row):
    m = row.max()
    return row - (m + np.log(np.exp(row - m).sum()))


def top5(row):
    lp = log_softmax(row)
    idx = np.argsort(-row, kind="stable")[:5]
    return [[int(i), round(float(lp[i]), 5)] for i in idx]


def teacher_forced_rows(llm, prompt, tokens):
    """Logits after the prompt and after each of `tokens` but the last."""
    llm.reset()
    llm.eval(prompt)
    rows = [last_logits(llm)]
    for t in tokens[:-1]:
        llm.eval([t])
        rows.append(last_logits(llm))
    return rows


def model_doc(name, path, template_file, threads):
    common = dict(n_ctx=N_CTX, n_threads=threads, logits_all=False, seed=0, verbose=False)
    llm = Llama(model_path=path, **common)
    md = llm.metadata
    if template_file:
        with open(os.path.join(GOLDEN_DIR, template_file), encoding="utf-8") as f:
            template = f.read()
    else:
        template = md["tokenizer.chat_template"]
    render = make_renderer(template)
    tok_text = llm._model.token_get_text
    bos_text = tok_text(llm.token_bos()) if llm.token_bos() >= 0 else ""
    eos_text = tok_text(llm.token_eos()) if llm.token_eos() >= 0 else ""

    prepared = []
    for case in CASES:
        text = render.render(messages=case["messages"], add_generation_prompt=True,
                             bos_token=bos_text, eos_token=eos_text)
        toks = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert len(toks) + N_GREEDY <= N_CTX, (case["name"], len(toks))
        prepared.append((case, text, toks))

    cases = []
    for case, text, toks in prepared:
        llm.reset()
        llm.eval(toks)
        row = last_logits(llm)
        gen, margins, tops = [], [], []
        for _ in range(N_GREEDY):
            t = int(np.argmax(row))  # ties -> lowest id
            top = np.partition(row, -2)[-2:]
            gen.append(t)
            margins.append(round(float(top.max() - top.min()), 5))
            tops.append(top5(row))
            llm.eval([t])
            row = last_logits(llm)
        cases.append({"name": case["name"], "messages": case["messages"], "prompt_text": text,
                      "prompt_tokens": toks, "n_prompt_tokens": len(toks), "greedy_tokens": gen,
                      "greedy_text": llm.detokenize(gen, special=True).decode("utf-8", errors="replace"),
                      "greedy_logits_top2_margin": margins, "greedy_top5": tops})
        print(f"{name}/{case['name']}: {len(toks)} prompt tokens, greedy={cases[-1]['greedy_text'][:50]!r}",
              file=sys.stderr)
    del llm

    # The noise floor: llama.cpp against itself with f32 KV, the same tokens teacher-forced.
    llm32 = Llama(model_path=path, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, **common)
    for c in cases:
        rows = teacher_forced_rows(llm32, c["prompt_tokens"], c["greedy_tokens"])
        worst = 0.0
        for row, step in zip(rows, c["greedy_top5"]):
            lp = log_softmax(row)
            worst = max(worst, max(abs(float(lp[i]) - want) for i, want in step))
        c["f32_kv_top5_logprob_max_abs_diff"] = round(worst, 5)
        c["f32_kv_argmax_equal"] = all(int(np.argmax(r)) == t for r, t in zip(rows, c["greedy_tokens"]))
    del llm32

    return {
        "format": {
            "version": 1,
            "prompt_text": "chat template (template_file when set, else the GGUF's) rendered with jinja2 as in golden.py",
            "prompt_tokens": "llama_tokenize(prompt_text, add_special=False, parse_special=True)",
            "greedy_tokens": f"{N_GREEDY} argmax steps over llama.cpp logits (f16 KV, one token per decode after "
                             "the prompt batch); no sampler, no EOS stop; ties to the lowest id",
            "greedy_top5": "per step [[id, logprob] x5], logprob = log-softmax over the full vocabulary (f64)",
            "greedy_logits_top2_margin": "per step, top1 - top2 logit",
            "f32_kv_top5_logprob_max_abs_diff": "max over steps and top-5 ids of |logprob with f32 KV - logprob "
                                                "with f16 KV|, same tokens teacher-forced (llama.cpp's own noise)",
        },
        "generator": "scripts/llamacpp/golden_models.py",
        "model": name,
        "model_file": os.path.basename(path),
        "model_sha256": sha256_file(path),
        "template_file": template_file,
        "bos_text": bos_text,
        "eos_text": eos_text,
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp_commit": llama_cpp_commit(),
        "llama_params": {"n_ctx": N_CTX, "n_threads": threads, "type_k": "f16", "type_v": "f16", "flash_attn": False},
        "system_info": llama_cpp.llama_print_system_info().decode("utf-8", errors="replace"),
        "cases": cases,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", action="append", choices=sorted(MODELS), help="only this model (repeatable)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=PATH", help="the file of model NAME")
    # Each output element is one thread's dot product in ggml, so the thread count does not
    # change the logits; 1 thread is much faster than 2 on a machine loaded by other work.
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    paths = {}
    for name, (file, env, _) in MODELS.items():
        paths[name] = (env and os.environ.get(env)) or os.path.join(model_cache_dir(), file)
    for kv in args.model:
        name, path = kv.split("=", 1)
        paths[name] = path
    for name in args.only or sorted(MODELS):
        path = paths[name]
        if not os.path.exists(path):
            hint = "scripts/fetch-model.sh gemma3" if name.startswith("gemma") else "scripts/llamacpp/requantize.sh"
            print(f"skipped {name}: {path} not found (run {hint})", file=sys.stderr)
            continue
        doc = model_doc(name, path, MODELS[name][2], args.threads)
        out = os.path.join(GOLDEN_DIR, f"llamacpp_{name}.json")
        # Written beside and renamed, so a failed write (a full disk) leaves no truncated golden.
        with open(out + ".tmp", "w", encoding="utf-8") as f:
            # Indented, with each list of numbers on one line: diffable and small. Only
            # lists that json.dumps spread over lines (a newline after every item) are
            # joined: a newline never occurs raw inside a JSON string, so text such as
            # "[0, 1]" in a prompt is left alone (it once was not, and the stored prompt
            # text lost its space while its token IDs kept it).
            text = json.dumps(doc, ensure_ascii=False, indent=1)
            text = re.sub(r"\[(\n\s*-?[\d.e-]+(?:,\n\s*-?[\d.e-]+)*\n\s*)\]",
                          lambda m: "[" + "".join(m.group(1).split()) + "]", text)
            f.write(text)
            f.write("\n")
        os.replace(out + ".tmp", out)
        n = [c["n_prompt_tokens"] for c in doc["cases"]]
        print(f"wrote {out}: {len(n)} cases, prompts {min(n)}-{max(n)} tokens, "
              f"{sum(x > 512 for x in n)} past 512")


if __name__ == "__main__":
    main()
