#!/usr/bin/env python3
"""Trains the small byte-level BPE tokenizer of the tiny test models (tests/fixtures/{tiny,realwidth}).

ids 0..255: the 256 bytes (id = byte value, in ByteLevel unicode form); ids 256..3999: 3,744 merges
learnt from the parity corpus plus the chat template (deterministic: counts, then the lexicographically
smallest pair on ties); ids 4000..4032: the 33 Qwen3.6 added tokens (model-spec §5.2). The same
tokenizer.json format, normalizer, Split regex, decoder and tokenizer_config as Qwen3.6.
Pre-tokenisation for *training* approximates the Split regex with Python's `re` (no \\p{..} in the
stdlib); that only shapes which merges are learnt, the encoding itself is defined by tokenizer.json.
Usage: train_tiny.py CORPUS.jsonl.gz TEMPLATE.jinja OUT_DIR [OUT_DIR...]"""
import collections
import gzip
import json
import os
import re
import sys
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen36  # noqa: E402

N_REGULAR = 4000
APPROX = re.compile(r"'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])|[^\r\n\w]?[^\W\d_]+|\d"
                    r"| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+|_+")


def main():
    corpus, template, outs = sys.argv[1], sys.argv[2], sys.argv[3:]
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        texts = [json.loads(line) for line in f]
    with open(template, encoding="utf-8") as f:
        texts += [f.read()] * 20
    b2u = qwen36.bytes_to_unicode()
    counts = collections.Counter()
    for t in texts:
        for piece in APPROX.findall(unicodedata.normalize("NFC", t)):
            counts[piece] += 1
    words = [[b2u[b] for b in w.encode("utf-8")] for w in counts]
    freqs = list(counts.values())
    vocab = {b2u[b]: b for b in range(256)}
    pair_count = collections.Counter()
    where = collections.defaultdict(set)
    for i, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pair_count[(a, b)] += freqs[i]
            where[(a, b)].add(i)
    merges = []
    while len(vocab) < N_REGULAR:
        best = max(pair_count.items(), key=lambda kv: (kv[1], [-ord(c) for c in kv[0][0] + "\0" + kv[0][1]]))
        (a, b), c = best
        if c <= 0:
            raise SystemExit(f"corpus too small: {len(vocab)} tokens")
        new = a + b
        merges.append([a, b])
        vocab[new] = len(vocab)
        for i in list(where[(a, b)]):
            w = words[i]
            for x, y in zip(w, w[1:]):
                pair_count[(x, y)] -= freqs[i]
            j, nw = 0, []
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    nw.append(new)
                    j += 2
                else:
                    nw.append(w[j])
                    j += 1
            words[i] = nw
            for x, y in zip(nw, nw[1:]):
                pair_count[(x, y)] += freqs[i]
                where[(x, y)].add(i)
        del pair_count[(a, b)]
        del where[(a, b)]
        for k in [k for k, v in pair_count.items() if v <= 0]:
            del pair_count[k]
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": qwen36.added_tokens_json(N_REGULAR),
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            qwen36.split_pretokenizer(),
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    with open(template, encoding="utf-8") as f:
        tmpl = f.read()
    cfg = {"add_bos_token": False, "add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "errors": "replace", "model_max_length": 262144,
           "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
           "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                    for a in tok["added_tokens"]},
           "chat_template": tmpl}
    for out in outs:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tok, f, ensure_ascii=False, indent=1)
            f.write("\n")
        with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, ensure_ascii=False, indent=2)
            f.write("\n")
        with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(tmpl)
    print(f"{len(vocab)} regular tokens ({len(merges)} merges) + {len(tok['added_tokens'])} added -> {outs}")


if __name__ == "__main__":
    main()
