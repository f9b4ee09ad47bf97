#!/usr/bin/env python3
"""Builds kestrel's test fixtures from the reference implementation (HF transformers qwen3_5_moe).

Runs on the GPU machine (transformers 5.17 + torch there; no GPU needed, the reference runs in fp32
on the CPU). Two modes:

  tiny       builds a tiny random Qwen3_5MoeForConditionalGeneration (real tensor names: fused experts,
             model.language_model.*, lm_head, a small model.visual.*, plus fake mtp.* tensors to exercise
             the loader's skip path), saves it in bf16 as a complete model directory, and writes
             reference.safetensors computed by transformers in fp32 on the same bf16-rounded weights.
  reference  computes reference.safetensors for an existing model directory (e.g. the real-width model
             synthesized by `kestrel synth-model`, whose weights are regenerated in CI from a seed).

reference.safetensors (all fp32/int32):
  prompt_ids    I32 [T]        the prompt (T >= 70, so the chunked GDN path crosses a chunk boundary)
  prompt_logits F32 [T, V]     logits at every prompt position (one forward over the whole prompt)
  greedy_tokens I32 [S+1]      greedy continuation: greedy_tokens[0] = argmax(prompt_logits[T-1])
  decode_logits F32 [S, V]     logits after feeding greedy_tokens[s] (single-token cached steps), so
                               greedy_tokens[s+1] = argmax(decode_logits[s])

Command (from the repo root, on the GPU machine): bash tools/device/fixtures.sh
"""
import argparse
import json
import math
import os
import sys

import torch
from safetensors.torch import load_file, save_file

PROMPT_LEN = 80
DECODE_STEPS = 20
VOCAB = 4096
EOS = [4002, 4000]  # <|im_end|>, <|endoftext|> in the fixtures' small tokenizer (ids 4000..4032 added)


def tiny_text_config():
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2
    return {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 128,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "bos_token_id": 4000,
        "eos_token_id": 4000,
        "pad_token_id": None,
        "dtype": "bfloat16",
        "initializer_range": 0.02,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "use_cache": True,
    }


def tiny_vision_config():
    return {
        "model_type": "qwen3_5_moe",
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 128,
        "num_position_embeddings": 64,
        "hidden_act": "gelu_pytorch_tanh",
        "deepstack_visual_indexes": [],
        "initializer_range": 0.02,
    }


def wrapper_config(text):
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "image_token_id": 4028,
        "video_token_id": 4029,
        "vision_start_token_id": 4025,
        "vision_end_token_id": 4026,
        "tie_word_embeddings": False,
        "eos_token_id": EOS,
        "text_config": text,
        "vision_config": tiny_vision_config(),
    }


def generation_config():
    return {
        "bos_token_id": 4000,
        "do_sample": True,
        "eos_token_id": EOS,
        "pad_token_id": 4000,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    }


@torch.no_grad()
def randomize(model, gen):
    """Every parameter random (so a missing 1+w, a swapped gate or a wrong head map shows up)."""
    for name, p in model.named_parameters():
        if name.startswith("model.visual"):
            p.normal_(0.0, 0.02, generator=gen)
            continue
        if name.endswith("A_log"):
            p.uniform_(0.0, 2.5, generator=gen)
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 0.5, generator=gen)
        elif "conv1d" in name:
            p.normal_(0.0, 0.35, generator=gen)
        elif name.endswith("linear_attn.norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif "norm" in name:  # zero-centred norms (1+w)
            p.normal_(0.0, 0.2, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0, generator=gen)
        elif p.dim() >= 2:
            fan_in = p.shape[-1]
            p.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
        else:
            p.normal_(0.0, 0.1, generator=gen)
    # lm_head a little sharper so greedy argmaxes are well separated.
    model.lm_head.weight.mul_(2.0)


def add_fake_mtp(path, hidden):
    """Adds mtp.* tensors (real names, tiny shapes) so the loader's skip path is exercised."""
    t = load_file(path)
    g = torch.Generator().manual_seed(7)
    def r(*shape):
        return (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    t["mtp.fc.weight"] = r(hidden, 2 * hidden)
    t["mtp.pre_fc_norm_embedding.weight"] = r(hidden)
    t["mtp.pre_fc_norm_hidden.weight"] = r(hidden)
    t["mtp.norm.weight"] = r(hidden)
    t["mtp.layers.0.input_layernorm.weight"] = r(hidden)
    t["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = r(8, hidden)
    save_file(t, path, metadata={"format": "pt"})


@torch.no_grad()
def reference(model_dir, prompt_seed=1234):
    from transformers import Qwen3_5MoeForConditionalGeneration
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    g = torch.Generator().manual_seed(prompt_seed)
    prompt = torch.randint(0, min(vocab, 4000), (PROMPT_LEN,), generator=g)
    ids = prompt.view(1, -1)
    out = model(input_ids=ids, use_cache=True)
    prompt_logits = out.logits[0].float().clone()
    past = out.past_key_values
    tok = int(prompt_logits[-1].argmax())
    greedy = [tok]
    decode_logits = []
    for s in range(DECODE_STEPS):
        pos = PROMPT_LEN + s
        try:
            o = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True,
                      cache_position=torch.tensor([pos]))
        except TypeError:
            o = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = o.past_key_values
        lg = o.logits[0, -1].float().clone()
        decode_logits.append(lg)
        tok = int(lg.argmax())
        greedy.append(tok)
    # Cross-check: one forward over prompt + generated tokens must give the same last logits
    # (chunked GDN vs recurrent decode inside transformers).
    full = torch.cat([prompt, torch.tensor(greedy[:-1])]).view(1, -1)
    lf = model(input_ids=full, use_cache=False).logits[0, -1].float()
    drift = float((lf - decode_logits[-1]).abs().max() / decode_logits[-1].abs().max())
    print(f"[{model_dir}] transformers self-check, full forward vs cached decode: {drift:.3e}")
    top2 = [float(torch.topk(l, 2).values[0] - torch.topk(l, 2).values[1]) for l in decode_logits]
    print(f"[{model_dir}] greedy {greedy}; min top-2 gap {min(top2):.4f}")
    return {
        "prompt_ids": prompt.to(torch.int32).contiguous(),
        "prompt_logits": prompt_logits.contiguous(),
        "greedy_tokens": torch.tensor(greedy, dtype=torch.int32),
        "decode_logits": torch.stack(decode_logits).contiguous(),
    }


def make_tiny(out_dir):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    os.makedirs(out_dir, exist_ok=True)
    text = tiny_text_config()
    wrapper = wrapper_config(text)
    config = Qwen3_5MoeConfig(**{k: v for k, v in wrapper.items() if k != "architectures"})
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(config)
    randomize(model, torch.Generator().manual_seed(42))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    # Our own config.json, exactly in the official layout (save_pretrained may add/rename fields).
    saved = json.load(open(os.path.join(out_dir, "config.json")))
    print("saved config keys:", sorted(saved.keys()))
    json.dump(wrapper, open(os.path.join(out_dir, "config.json"), "w"), indent=2)
    json.dump(generation_config(), open(os.path.join(out_dir, "generation_config.json"), "w"), indent=2)
    st = os.path.join(out_dir, "model.safetensors")
    assert os.path.exists(st), os.listdir(out_dir)
    add_fake_mtp(st, text["hidden_size"])
    keys = sorted(load_file(st).keys())
    print(f"{len(keys)} tensors; sample:", [k for k in keys if ".layers.0." in k or "layers" not in k][:40])
    ref = reference(out_dir)
    save_file(ref, os.path.join(out_dir, "reference.safetensors"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["tiny", "reference"])
    ap.add_argument("--out", required=True, help="model directory to create (tiny) or read (reference)")
    ap.add_argument("--ref-out", help="where to write reference.safetensors (reference mode)")
    a = ap.parse_args()
    torch.set_num_threads(min(16, os.cpu_count() or 1))
    if a.mode == "tiny":
        make_tiny(a.out)
    else:
        ref = reference(a.out)
        save_file(ref, a.ref_out or os.path.join(a.out, "reference.safetensors"))


if __name__ == "__main__":
    sys.exit(main())
