#!/usr/bin/env python3
"""Deterministic tokenizer parity corpus (tests/fixtures/tokenizer/corpus.jsonl.gz).

Every string class the Qwen pre-tokenizer regex distinguishes: letters of each case class, combining
marks (alone, after letters, after digits/punctuation), digit runs (ASCII and other Nd/Nl/No),
punctuation and symbol runs, whitespace runs (space, tab, NBSP, ideographic space, U+0085, U+2028) with
\\r\\n mixes, contractions (incl. case variants and U+017F), code, CJK, emoji (ZWJ, flags, skin tones),
added-token literals, and very long lines (no spaces, long digit runs, long whitespace).
Usage: python3 tools/tokenizer/make_corpus.py [out.jsonl.gz]   (stdlib only; seeded, byte-stable)
"""
import gzip
import json
import random
import sys
import unicodedata

R = random.Random(20261202)

FIXED = [
    "", " ", "  ", "\n", "\r\n", "\r", "\t", "a", "A", "Hello world", "Hello, world!",
    "Hello\nworld", "Hello\r\nworld\r\n", "   leading spaces", "trailing spaces   ",
    "trailing newline\n", "\n\n\nmany newlines\n\n\n", " \n \n \n", "\t\tTabbed\tcontent\t",
    "I'm here, you're there, we've gone, he'll go, she'd say, it's, don't",
    "I'M HERE, YOU'RE THERE, WE'VE, HE'LL, SHE'D, IT'S, DON'T", "I'Ll 'Re 'vE 'Ve 'ſ 'ſt",
    "'s's's 'ss 't 'tt", "rock'n'roll", "l'homme d'état", "’s curly ’t",
    "1234567890", "12 345 6789", "3.14159", "-42", "+1e-10", "0x1F 0b1010 0o777",
    "v1.2.3-rc.4+build.5", "2026-12-02T15:35:06Z", "$1,234.56", "100%", "½ ¾ ⅓ ① ② ⅷ Ⅻ",
    "٠١٢٣٤٥٦٧٨٩", "०१२३४५६७८९", "１２３４５", "𝟘𝟙𝟚𝟛",
    "e\u0301", "\u00e9", "e\u0301\u0301\u0301", "\u0301", "\u0301abc", "1\u0301", "!\u0301",
    " \u0301", "\n\u0301", "a\u20dd", "\u0915\u094d\u0937", "नमस्ते दुनिया", "ﾃﾞｨｰ",
    "Å Å Å", "ﬁ ﬂ ﬃ", "Ǆ ǅ ǆ ǈ", "ᾼ ῌ ῼ", "Ⅸ ⅸ", "ǅungla",
    "你好，世界！", "我爱自然语言处理。", "日本語のテキスト、カタカナ、ひらがな。", "한국어 텍스트입니다.",
    "中文English混合mixed文本123数字", "Привет, мир!", "Γειά σου Κόσμε", "שלום עולם", "مرحبا بالعالم",
    "ไทย ภาษา", "Tiếng Việt có dấu", "ქართული", "Հայերեն", "አማርኛ", "ᚠᛇᚻ᛫ᛒᛦᚦ",
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇩🇪🇫🇷", "🏳️‍🌈", "❤️", "☺︎", "1️⃣", "emoji😀in😀text",
    "😀😀😀😀😀", " 😀 ", "🤖🚀✨", "\U0001f9d1\u200d\U0001f4bb",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
    "</tool_call>", "<tool_response>", "</tool_response>", "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|><|im_end|>", "<|im_start", "|im_end|>", "<<|im_start|>>", "<think></think>",
    "a<think>b</think>c", "<|vision_start|><|image_pad|><|vision_end|>", "<|fim_prefix|>x<|fim_suffix|>",
    "<|audio_start|><|audio_pad|><|audio_end|>", "<tts_pad><tts_text_bos><tts_text_eod><tts_text_bos_single>",
    "<|endoftext|><|endoftext|>", " <|im_end|> ", "\n<|im_end|>\n",
    "def f(x):\n    return x**2 + 1\n", "int main() { return 0; }\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n", "if x == 1:\r\n    pass\r\n",
    "#include <stdio.h>\n", "console.log(`template ${x}`);", "SELECT * FROM t WHERE a='b';",
    "<div class=\"x\">&amp;&lt;</div>", "{\"key\": [1, 2, {\"n\": null}]}", "a->b; c=>d; e::f",
    "    \n    \n", "x\u00a0y", "x\u3000y", "x\u0085y", "x\u2028y", "x\u2029y", "x\u200by", "x\u200dy",
    "x\ufeffy", "x\u180ey", "x\u1680y", "x\u202fy", "x\u205fy", "x\u2003\u2003y", "x\x0by\x0cz",
    "\x00\x01\x1f\x7f", "a\x00b", "\ue000\uf8ff", "\U000f0000", "\ufffd", "\ufffd\ufffd",
    "...", "!!!", "?!?!", "---", "___", "***", "~~~", "@@", "##", "$$$", "%%%", "^^^", "&&&",
    "((()))", "[[[]]]", "{{{}}}", "<<<>>>", "\"\"\"", "'''", "```", "|||", "\\\\\\",
    "a.\n", "a.\n\n", "a.\r\n\r\n", "!\n!\n", " !\n", "\n!", "x \n", "x  \n  y", "x\n \ny",
    "x \t \n \t y", " \r\n ", "\r\r\n\n", "\n\r", "end.   ", "end.\t\t",
]

WORDS = ("the of and to in is was for on that with as by at from it be this are or an not have "
         "model token encode decode stream server kernel tensor attention expert router cache "
         "naïve café résumé façade coöperate Zürich São Paulo Łódź Kraków İstanbul ıi ß ẞ").split()
CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济喜离虽坐集编宝谈府拉黑且随格尽剑讲布杀微怕母调局根曾准团段终乐切级克精哪官示冷域"
SCRIPTS = [(0x41, 0x5a), (0x61, 0x7a), (0xc0, 0x24f), (0x370, 0x3ff), (0x400, 0x4ff), (0x530, 0x58f),
           (0x5d0, 0x5ea), (0x620, 0x64a), (0x900, 0x97f), (0xe01, 0xe3a), (0x10a0, 0x10ff),
           (0x3041, 0x3096), (0x30a1, 0x30fa), (0xac00, 0xd7a3), (0x4e00, 0x9fff)]
MARKS = [0x300, 0x301, 0x302, 0x303, 0x308, 0x30a, 0x327, 0x328, 0x20dd, 0x0e31, 0x093f, 0x094d, 0x05b7,
         0x064b, 0x0651, 0x1ab0, 0xfe0f, 0x20e3, 0x0903, 0x0488]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + ["¡", "¿", "«", "»", "—", "–", "…", "“", "”", "‘",
                                                    "’", "、", "。", "，", "！", "？", "·", "§", "¶",
                                                    "©", "®", "™", "°", "±", "×", "÷", "€", "£", "¥",
                                                    "₹", "∑", "∞", "≈", "≠", "→", "⇒", "♠", "★", "■"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n", "\n ", "\r", "\u00a0", "\u3000", "\u2009",
          " \t", "\t\n", "\r\n\r\n", "    "]
EMOJI = ["😀", "😂", "👍", "👍🏿", "🎉", "🔥", "💯", "🙏", "🇯🇵", "👩‍💻", "✅", "⚡", "🧠", "🌍", "🫠"]
ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
         "</tool_call>", "<tool_response>", "</tool_response>", "<|vision_pad|>", "<|fim_middle|>",
         "<|audio_end|>", "<tts_text_eod>"]


def rand_word():
    k = R.random()
    if k < 0.45:
        w = R.choice(WORDS)
        return w.upper() if R.random() < 0.1 else (w.capitalize() if R.random() < 0.2 else w)
    if k < 0.6:
        return "".join(R.choice(CJK) for _ in range(R.randint(1, 8)))
    if k < 0.8:
        lo, hi = R.choice(SCRIPTS)
        s = ""
        for _ in range(R.randint(1, 9)):
            s += chr(R.randint(lo, hi))
            if R.random() < 0.15:
                s += chr(R.choice(MARKS))
        return s
    if k < 0.9:
        return "".join(R.choice("0123456789") for _ in range(R.randint(1, 12)))
    if k < 0.95:
        return "".join(R.choice(PUNCT) for _ in range(R.randint(1, 4)))
    return R.choice(EMOJI)


def rand_text(n_words, with_added=False):
    out = []
    for _ in range(n_words):
        out.append(rand_word())
        r = R.random()
        if with_added and r < 0.05:
            out.append(R.choice(ADDED))
        elif r < 0.12:
            out.append(R.choice(PUNCT))
        out.append(R.choice(SPACES) if R.random() < 0.3 else " ")
    return "".join(out)


def rand_chars(n):
    # Random code points from assigned, old (Unicode <= 6) blocks of every general category.
    pools = [(0x20, 0x7e), (0xa0, 0x2ff), (0x300, 0x36f), (0x370, 0x3ff), (0x400, 0x52f), (0x2000, 0x206f),
             (0x2070, 0x209c), (0x20a0, 0x20b9), (0x2100, 0x218b), (0x2190, 0x23f3), (0x2460, 0x24ff),
             (0x2500, 0x27bf), (0x3000, 0x303f), (0x3040, 0x30ff), (0x4e00, 0x9fcc), (0xac00, 0xd7a3),
             (0xff00, 0xffef), (0x1f300, 0x1f5ff), (0x1d400, 0x1d7ff), (0xe000, 0xe0ff)]
    s = []
    while len(s) < n:
        lo, hi = R.choice(pools)
        c = chr(R.randint(lo, hi))
        if unicodedata.category(c) in ("Cn", "Cs"):
            continue
        s.append(c)
    return "".join(s)


def code_snippet():
    names = ["foo", "bar_baz", "camelCase", "HTTPServer", "x1", "_private", "__dunder__", "i", "j"]
    ops = [" = ", " += ", " == ", " != ", " -> ", "::", ".", "(", ")", "[", "]", "{", "}", ", ", "; "]
    lines = []
    for _ in range(R.randint(2, 10)):
        indent = R.choice(["", "  ", "    ", "\t", "        "])
        toks = [R.choice(names) if R.random() < 0.6 else R.choice(ops) for _ in range(R.randint(2, 10))]
        if R.random() < 0.2:
            toks.append(" // " + rand_text(3))
        if R.random() < 0.1:
            toks.append(str(R.randint(0, 10**9)))
        lines.append(indent + "".join(toks))
    return R.choice(["\n", "\r\n"]).join(lines) + R.choice(["", "\n", "\n\n", "\r\n"])


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tokenizer/corpus.jsonl.gz"
    corpus = list(FIXED)
    for _ in range(700):
        corpus.append(rand_text(R.randint(1, 30)))
    for _ in range(300):
        corpus.append(rand_text(R.randint(1, 20), with_added=True))
    for _ in range(400):
        corpus.append(rand_chars(R.randint(1, 40)))
    for _ in range(250):
        corpus.append(code_snippet())
    for _ in range(150):  # whitespace / newline mixes
        corpus.append("".join(R.choice(SPACES + ["x", ".", "1", "é", "中"]) for _ in range(R.randint(1, 25))))
    for _ in range(100):  # decomposed forms (NFC normalisation must recompose)
        corpus.append(unicodedata.normalize("NFD", rand_text(R.randint(1, 10))))
    # very long lines
    corpus.append("a" * 5000)
    corpus.append("x" * 20000)
    corpus.append("".join(R.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(30000)))
    corpus.append("".join(R.choice(CJK) for _ in range(8000)))
    corpus.append("9" * 5000)
    corpus.append("".join(R.choice("0123456789") for _ in range(10000)))
    corpus.append(" " * 3000 + "end")
    corpus.append("\n" * 2000)
    corpus.append("\r\n" * 1000 + "x")
    corpus.append("!" * 5000)
    corpus.append("😀" * 2000)
    corpus.append("e\u0301" * 3000)
    corpus.append(rand_text(3000))
    corpus.append(" ".join(code_snippet() for _ in range(50)))
    seen = set()
    uniq = []
    for s in corpus:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    with gzip.GzipFile(out, "wb", mtime=0) as f:
        for s in uniq:
            f.write((json.dumps(s, ensure_ascii=False) + "\n").encode("utf-8"))
    print(f"{len(uniq)} strings -> {out}")


if __name__ == "__main__":
    main()
