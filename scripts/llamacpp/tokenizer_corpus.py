#!/usr/bin/env python3
"""Writes engine/tests/golden/tokenizer_corpus.json: the texts on which Baton's
tokenizers must give llama.cpp's token IDs (scripts/llamacpp/tokenizer_golden.py
asks llama.cpp for them). Deterministic: the same file every run.

    python3 scripts/llamacpp/tokenizer_corpus.py [--out PATH]

The corpus is a JSON list of strings. Python strings here are Unicode, so
"invalid-looking" bytes appear as the text a client could send: U+FFFD,
mojibake, backslash escapes of surrogates spelled out, noncharacters.
"""

import argparse
import json
import os
import random

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

WHITESPACE = [
    "", " ", "  ", "   ", "    ", " " * 7, " " * 16, " " * 33, " " * 80,
    "\t", "\t\t", "\t" * 5, "\t" * 40, "\n", "\n\n", "\n" * 3, "\n" * 9, "\n" * 40,
    "\r\n", "\r\n\r\n", "\r", " \n ", "\n \n", " \t \t ", "\t\n\t\n", "\u00a0", "\u3000",
    "\u2003\u2009\u200a", "\u000b\u000c", "a b", "a  b", "a   b", "a    b    c",
    " leading", "  leading two", "trailing ", "trailing two  ", " both ", "\ttab lead",
    "line\n", "\nline", "line1\nline2\n\nline4\n\n\n", "x\r\ny\rz\n", "word \n word",
    "  \n  indented\n    more\n\tless", "mixed \t\n \u00a0\u2028\u2029 end",
]

DIGITS = [
    "0", "7", "42", "123", "1234", "12345", "1234567890", "00000", "007",
    "3.14159", "2.71828182845904523536", "-17", "+1 (555) 010-9999", "1,299.99",
    "$1,000,000", "€12,50", "50%", "1e-10", "6.022e23", "0x1F", "0b1011", "0o777",
    "2024-03-15", "09:45:00", "12:00 AM", "v1.2.3-rc.4", "192.168.0.1", "3/4",
    "1st 2nd 3rd 4th", "١٢٣٤٥", "०१२३४५६७८९", "１２３４５", "²³¹", "½ ¼ ¾", "Ⅻ ⅻ",
    "٣.١٤", "一二三四五", "9" * 64, "1234567890" * 12, "1 2 3 4 5 6 7 8 9 10",
    "x=1;y=22;z=333", "a1b2c3d4", "123abc456def", "3.0.0.0.0.1", "10,000 km²",
]

CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * c; }",
    "const add = (a, b) => a + b;\nconsole.log(add(1, 2));",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "<div class=\"box\" id='main'><span>Hi</span></div>",
    "{\"name\": \"Ada\", \"tags\": [\"a\", \"b\"], \"ok\": true, \"n\": null}",
    "if [ -f ~/.bashrc ]; then source ~/.bashrc; fi",
    "^(?:[a-z0-9!#$%&'*+/=?^_`{|}~-]+)@example\\.com$",
    "#include <stdio.h>\nint main(void) { printf(\"hi\\n\"); return 0; }",
    "    def __init__(self):\n        self.x = []\n\n    def __repr__(self):\n        return f\"<X {self.x!r}>\"",
    "x <- c(1, 2, 3); mean(x)",
    "<?php echo $_GET['q'] ?? 'none'; ?>",
    "SELECT * FROM t WHERE a <> b AND c != d || e;",
    "a->b; c::d; e=>f; g<=h; i>=j; k===l; m!==n; o**=p;",
    "```python\nprint('hi')\n```",
    "# Title\n\n- item **bold** _it_ `code`\n1. one\n> quote",
    "\\begin{equation} E = mc^2 \\end{equation}",
    "key: value\nlist:\n  - a\n  - b\n",
    "[section]\nname = \"baton\"\nversion = \"0.1.0\"",
    "https://example.com/path/to/page?query=1&lang=en#section",
    "john.doe+tag@example.org",
    "C:\\Users\\Admin\\Documents\\file.txt",
    "/usr/local/bin/python3 -m pip install -U pip",
    "lambda x: [y for y in range(x) if y % 2 == 0]",
    "match x { Some(v) if v > 0 => v, _ => 0 }",
    "<!DOCTYPE html><html><head><title>T</title></head><body></body></html>",
    "<table><tr><td>1</td><td>2</td></tr></table>",
    "<ul><li>a</li><li>b</li></ul><br/><hr>",
    "\t\tif (x) {\n\t\t\treturn;\n\t\t}\n",
]

SCRIPTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.",
    "don't I'll we're you've she'd it's they'RE DON'T",
    "Café déjà vu, naïve coöperation, façade, jalapeño.",
    "Grüße aus München: Äpfel, Öl, Übermaß, Straße.",
    "Où est la bibliothèque ? Très élégant, garçon, cœur.",
    "¿Dónde está el baño? ¡Olé!", "Ça va? Ærø Ønsker Åse", "Łódź, Kraków, Gdańsk, żółć",
    "Čeština: příliš žluťoučký kůň úpěl ďábelské ódy", "Türkçe: İstanbul ığdır şeker",
    "Tiếng Việt: Xin chào thế giới", "Română: știință, țară",
    "Ελληνικά: Καλημέρα κόσμε", "Русский: Привет, мир! Ёлка и ёжик.",
    "Українська: Ґанок, їжак, єнот", "Български: Здравей свят", "Српски: Ђурђевдан",
    "Հայերեն՝ Բարեւ աշխարհ", "ქართული: გამარჯობა მსოფლიო",
    "עברית: שלום עולם", "العربية: مرحبا بالعالم، كيف حالك؟", "فارسی: سلام دنیا",
    "اردو: ہیلو دنیا", "हिन्दी: नमस्ते दुनिया", "বাংলা: হ্যালো বিশ্ব", "தமிழ்: வணக்கம் உலகம்",
    "తెలుగు: హలో ప్రపంచం", "ಕನ್ನಡ: ನಮಸ್ಕಾರ", "മലയാളം: ഹലോ വേൾഡ്", "ગુજરાતી: નમસ્તે",
    "ਪੰਜਾਬੀ: ਸਤ ਸ੍ਰੀ ਅਕਾਲ", "සිංහල: ආයුබෝවන්", "ไทย: สวัสดีชาวโลก", "ລາວ: ສະບາຍດີ",
    "བོད་ཡིག: བཀྲ་ཤིས་བདེ་ལེགས།", "ខ្មែរ: សួស្តីពិភពលោក", "မြန်မာ: မင်္ဂလာပါ",
    "中文：你好，世界！我爱自然语言处理。", "繁體中文：臺灣的資訊科技產業", "日本語：こんにちは、東京タワーへ行きたいです。",
    "カタカナとひらがな、漢字。ｶﾀｶﾅ", "한국어: 안녕하세요 세계", "ᠮᠣᠩᠭᠣᠯ ᠪᠢᠴᠢᠭ",
    "አማርኛ: ሰላም ዓለም", "ᏣᎳᎩ ᎦᏬᏂᎯᏍᏗ", "ᐃᓄᒃᑎᑐᑦ", "Ⲙⲉⲧⲣⲉⲙⲛ̀ⲭⲏⲙⲓ", "𐌰𐌱𐌲 Gothic",
    "Hello世界Привет123مرحبا😀end", "mixed: English, Français, 日本, 한국, עברית, हिन्दी",
    "∀x∈ℝ: x²≥0 ∧ ∑ᵢ aᵢ ≤ ∞", "→ ← ↑ ↓ ⇒ ⇔ ≠ ≈ ± × ÷ √ ∫ ∂",
    "┌─┬─┐\n│a│b│\n└─┴─┘", "⠓⠑⠇⠇⠕ braille", "♠♣♥♦ ★☆ ☀☁☂ ♪♫", "ℌ𝔢𝔩𝔩𝔬 𝐁𝐨𝐥𝐝 𝒮𝒸𝓇𝒾𝓅𝓉",
    "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ", "ﬁ ﬂ ﬀ ligatures", "e\u0301 vs \u00e9, n\u0303, a\u030a",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dalgo",
    "zero\u200bwidth\u200cnon\u200djoiner", "\u202eRTL override\u202c and \u200fmark",
    "ο Ο ό ς σ Σ", "ǅ ǈ ǋ title case", "İı iI", "ß ẞ SS", "Ꭰ ꭰ cherokee case",
]

EMOJI = [
    "😀", "😀😃😄 🎉", "👍🏻 👍🏽 👍🏿", "🇫🇷🇩🇪🇯🇵🇺🇸", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🧑🏻‍💻",
    "🤷‍♀️", "#️⃣ *️⃣ 1️⃣", "❤️ ✅ ✔ ☑", "🫠🫶🪿", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "👩🏽‍🤝‍👩🏿", "🐈‍⬛",
    "Emoji: 😀 👍🏽 🇫🇷 👨‍👩‍👧‍👦 🏳️‍🌈 #️⃣", "text😀text", "😀" * 30, "🙂 🙃 🫥 😶‍🌫️",
    "🀄 🃏 🎴", "©️ ®️ ™️", "⌚⌛⏩⏰", "👋🏿hello👋", "🇦🇧🇨 lone regional indicators",
]

INVALID_LOOKING = [
    "\ufffd", "\ufffd\ufffd\ufffd", "a\ufffdb", "\\ud800", "\\udfff\\ud800", "\\xff\\xfe",
    "\\u0000", "Ã©", "Ã¼ber", "ï»¿BOM mojibake", "\ufeffBOM at start", "mid\ufeffBOM",
    "\uffff", "\ufffe", "\ufdd0\ufdef", "\ue000\uf8ff private use", "\U0010ffff", "\U000f0000",
    "a\u0000b\u0007c\u001bd", "\u0000", "\u0001\u0002\u0003", "\u007f DEL", "\u0085 NEL \u009f",
    "\u0008backspace", "\u001f\u001e\u001d\u001c", "\\n literal backslash n", "\\\\ double",
    "%00%ff%FE", "&#xD800; &amp; &lt;", "\u00ad soft hyphen", "\u034f CGJ", "\u2060 WJ",
    "\u180e mongolian vowel separator", "\U0001d11e musical", "\u0300 combining at start",
]

SPECIAL_TEXTS = [
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n",
    "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "[multimodal]", "<unused0>", "<unused99>",
    "<start_of_image>", "<end_of_image>", "<start_of_turn", "<<start_of_turn>>",
    "<start_of_turn> user", "text<end_of_turn>text", "</div>", "<div>", "<0x41>", "<0x0A>",
    "\u2581", "\u2581\u2581hello", "hello\u2581world", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start |> <im_start> <|notatoken|>",
    "<bos><bos>", "<eos> after", "before <eos>", "  <start_of_turn>  ", "\n<end_of_turn>\n",
    "[EMPTY_0]", "<s></s>", "<end_of_turn><end_of_turn>", "<start_of_turn>model\n<think>",
]

LONG = [
    "a" * 500, "supercalifragilisticexpialidocious" * 15,
    "Donaudampfschifffahrtselektrizitätenhauptbetriebswerkbauunterbeamtengesellschaft",
    "pneumonoultramicroscopicsilicovolcanoconiosis " * 4,
    "Llanfairpwllgwyngyllgogerychwyrndrobwllllantysiliogogogoch",
    "x" * 257, "ab" * 200, "日本語" * 100, "Привет" * 60, "ñ" * 300, "🎉" * 64,
    "-" * 120, "=" * 80 + "\n" + "#" * 80, "." * 100, "_" * 90,
    "https://example.com/" + "very-long-path-segment/" * 20,
    "The quick brown fox jumps over the lazy dog. " * 12,
    "lorem" + "ipsum" * 80,
]


def generated(rng, n):
    """Mixes of the fragments above, to meet boundaries between kinds."""
    pool = [s for group in (WHITESPACE, DIGITS, SCRIPTS, EMOJI, INVALID_LOOKING, SPECIAL_TEXTS)
            for s in group if s and len(s) < 60]
    pool += ["'s", "'re", " the", "The", "ing", "tion", ".", ",", "!", "?", ":", ";", "(", ")",
             "[", "]", "{", "}", "\"", "'", "`", "-", "_", "/", "\\", "|", "@", "#"]
    out = []
    for _ in range(n):
        k = rng.randint(2, 7)
        out.append("".join(rng.choice(pool) for _ in range(k)))
    return out


def corpus():
    rng = random.Random(20261202)
    texts = WHITESPACE + DIGITS + CODE + SCRIPTS + EMOJI + INVALID_LOOKING + SPECIAL_TEXTS + LONG
    texts += generated(rng, 120)
    seen, out = set(), []
    for t in texts:
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "engine", "tests", "golden", "tokenizer_corpus.json"))
    args = ap.parse_args()
    texts = corpus()
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(f"{len(texts)} texts -> {args.out}")


if __name__ == "__main__":
    main()
