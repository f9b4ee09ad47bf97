"""Qwen3.5/3.6 tokenizer constants shared by the tokenizer tools (model-spec §5)."""

# Split pre-tokenizer regex of Qwen3.5/3.6 (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35).
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# The 33 added tokens in id order with their HF `special` flag (model-spec §5.2).
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False), ("<|audio_start|>", True),
    ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
]
assert len(ADDED_TOKENS) == 33


def added_tokens_json(first_id):
    return [{"id": first_id + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": s} for i, (c, s) in enumerate(ADDED_TOKENS)]


def split_pretokenizer():
    return {"type": "Split", "pattern": {"Regex": SPLIT_REGEX}, "behavior": "Isolated", "invert": False}


def bytes_to_unicode():
    """GPT-2 byte -> printable unicode char map (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
