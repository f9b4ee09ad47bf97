#!/usr/bin/env python3
"""Writes the MLX-layout 4-bit copy of the tiny fixture, its transformers reference logits, and the
quantizer-parity vectors. An implementation of MLX's affine quantization independent of kestrel's
C++ (src/quant/affine.cpp), written from MLX's sources/documentation:

  mlx `affine_quantize` (GPU kernels, mlx/backend/metal/kernels/quantized.h; the CUDA backend is
  the same), in IEEE fp32, per group of 64 row elements:
    w_min = min(w); w_max = max(0, max(w))
    s = max((w_max - w_min) / (2^b - 1), 1e-7); side = |w_min| > |w_max|
    s = s if side else -s; edge = w_min if side else w_max; q0 = round(edge / s)  (half away from 0)
    if q0 != 0: s = edge / q0; bias = edge   else: bias = 0
    q = min(round((w - bias) / s), 2^b - 1); scales/biases stored as bf16(s), bf16(bias)
  layout: u32 words, 32/b codes per word, least-significant bits first.
  mlx-lm (`convert` -> qwen3_5_moe sanitize + quantize_model + save_model): names
  language_model.model.* / language_model.lm_head, experts stacked as mlp.switch_mlp.*_proj
  [E, N, K], conv1d [C, K, 1], +1 baked into input/post_attention/final/q/k norms (bf16),
  routers (mlp.gate) and shared_expert_gate at 8 bits (per-module overrides in the config), matrices
  whose input width is not a multiple of 64 left unquantized, MTP and vision dropped,
  config "quantization" == "quantization_config", vision_config removed.

The quantizer and the safetensors I/O are pure Python (float32 emulated exactly: every single
+,-,*,/ on float32 values is computed in double and rounded once to float32, which is the correctly
rounded float32 result), so everything but --reference runs without numpy/torch. --reference needs
torch + transformers (GPU machine): it writes the tiny model's weights DEQUANTISED (fp32) as an HF
checkpoint and runs tools/make_fixtures.py's reference() on it (fp32, eager), same prompt.

  python3 tools/make_mlx_fixture.py --src tests/fixtures/tiny --out tests/fixtures/tiny-mlx4 \
      --parity tests/fixtures/quant/parity.safetensors [--reference]
"""
import argparse
import json
import math
import os
import random
import shutil
import struct
import sys
import tempfile
from array import array

GROUP = 64
FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "U32": 4, "I32": 4}


# ---------------------------------------------------------------- float32 / bf16 helpers
def f32(xs):
    """Rounds a list of doubles to float32 (round to nearest even), back as doubles."""
    return array("f", xs).tolist()


def f32s(x):
    return array("f", [x])[0]


def bf16_bits(xs):
    """float32 values -> bf16 bit patterns (round to nearest even, as torch/MLX)."""
    out = []
    for u in array("I", array("f", xs).tobytes()):
        if (u & 0x7FFFFFFF) > 0x7F800000:
            out.append(((u >> 16) | 0x40) & 0xFFFF)
        else:
            out.append(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)
    return out


def bf16_to_f32(hs):
    return array("f", array("I", [h << 16 for h in hs]).tobytes()).tolist()


def round_away(x):
    """round() of a float32 value, half away from zero (Metal/CUDA round); exact in double."""
    return math.copysign(math.floor(abs(x) + 0.5), x)


# ---------------------------------------------------------------- MLX affine quantization
def quantize_group(w, bits):
    """w: 64 float32 values (doubles). Returns (codes list, scale bf16 bits, bias bf16 bits)."""
    n_bins = float((1 << bits) - 1)
    eps = f32s(1e-7)
    w_min = min(FLT_MAX, min(w))
    w_max = max(0.0, max(w))
    scale = max(f32s(f32s(w_max - w_min) / n_bins), eps)
    side = abs(w_min) > abs(w_max)
    scale = scale if side else -scale
    edge = w_min if side else w_max
    q0 = round_away(f32s(edge / scale))
    if q0 != 0.0:
        scale = f32s(edge / q0)
        bias = edge
    else:
        bias = 0.0
    d = f32([x - bias for x in w])
    q = f32([x / scale for x in d])
    codes = [int(min(max(round_away(x), 0.0), n_bins)) for x in q]
    sb = bf16_bits([scale, bias])
    return codes, sb[0], sb[1]


def quantize_rows(rows, bits):
    """rows: list of rows (lists of float32 values). Returns (u32 words, scales, biases) flat."""
    per = 32 // bits
    words, scales, biases = array("I"), array("H"), array("H")
    for row in rows:
        assert len(row) % GROUP == 0
        for g in range(0, len(row), GROUP):
            codes, s, b = quantize_group(row[g:g + GROUP], bits)
            for k in range(0, GROUP, per):
                word = 0
                for i in range(per):
                    word |= codes[k + i] << (bits * i)
                words.append(word)
            scales.append(s)
            biases.append(b)
    return words, scales, biases


def dequantize_rows(words, scales, biases, nrows, cols, bits):
    """fp32 w = s*q + b with s, b from bf16, each op rounded to float32 (no FMA), as dequant_row."""
    per = 32 // bits
    mask = (1 << bits) - 1
    s_f = bf16_to_f32(scales)
    b_f = bf16_to_f32(biases)
    out = []
    wpr = cols // per
    gpr = cols // GROUP
    for r in range(nrows):
        for j in range(cols):
            q = (words[r * wpr + j // per] >> (bits * (j % per))) & mask
            g = r * gpr + j // GROUP
            out.append(f32s(f32s(s_f[g] * q) + b_f[g]))
    return out


# ---------------------------------------------------------------- safetensors I/O
def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        out[name] = (t["dtype"], list(t["shape"]), data[base + a:base + b])
    return out, meta


def write_safetensors(path, tensors, metadata):
    """tensors: name -> (dtype, shape, bytes). Larger dtypes first so offsets stay aligned."""
    names = sorted(tensors, key=lambda k: (-DTYPE_SIZE[tensors[k][0]], k))
    header = {"__metadata__": metadata}
    off = 0
    for k in names:
        dt, shape, b = tensors[k]
        numel = 1
        for d in shape:
            numel *= d
        assert numel * DTYPE_SIZE[dt] == len(b), (k, dt, shape, len(b))
        header[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(b)]}
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - (len(h) + 8) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for k in names:
            f.write(tensors[k][2])


def to_f32_list(dt, b):
    if dt == "BF16":
        return bf16_to_f32(array("H", b))
    if dt == "F32":
        return array("f", b).tolist()
    raise ValueError(f"unsupported dtype {dt}")


def rows_of(values, ncols):
    return [values[i:i + ncols] for i in range(0, len(values), ncols)]


# ---------------------------------------------------------------- HF -> MLX conversion
ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")


def module_bits(module, cols, default_bits=4):
    """The mlx-lm recipe: width rule first, then the qwen3_5 quant_predicate."""
    if cols % GROUP != 0:
        return 0
    if module.endswith("mlp.gate") or module.endswith("shared_expert_gate"):
        return 8
    return default_bits


def mlx_name(hf):
    if hf.startswith("model.language_model."):
        return "language_model.model." + hf[len("model.language_model."):]
    if hf == "lm_head.weight":
        return "language_model.lm_head.weight"
    raise ValueError(hf)


def convert(src_dir, out_dir):
    tensors, _ = read_safetensors(os.path.join(src_dir, "model.safetensors"))
    config = json.load(open(os.path.join(src_dir, "config.json")))
    text = config.get("text_config", config)
    E = text["num_experts"]
    L = text["num_hidden_layers"]
    # 1. sanitize: drop vision/MTP, rename, stack experts, transpose conv1d, +1 norms.
    w = {}
    for k, (dt, shape, b) in tensors.items():
        if k.startswith("model.visual") or k.startswith("mtp.") or "mtp." in k:
            continue
        if ".mlp.experts." in k:
            continue  # stacked below
        w[mlx_name(k)] = (dt, shape, b)
    for li in range(L):
        p = f"model.language_model.layers.{li}.mlp.experts."
        if p + "gate_up_proj" in tensors:  # fused layout
            dt, (e, n2, hk), b = tensors[p + "gate_up_proj"]
            n = n2 // 2
            es = DTYPE_SIZE[dt]
            gate = b"".join(b[(x * n2) * hk * es:(x * n2 + n) * hk * es] for x in range(e))
            up = b"".join(b[(x * n2 + n) * hk * es:(x * n2 + n2) * hk * es] for x in range(e))
            o = f"language_model.model.layers.{li}.mlp.switch_mlp."
            w[o + "gate_proj.weight"] = (dt, [e, n, hk], gate)
            w[o + "up_proj.weight"] = (dt, [e, n, hk], up)
            w[o + "down_proj.weight"] = tensors[p + "down_proj"]
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            parts = [tensors[f"{p}{x}.{proj}.weight"] for x in range(E)]
            dt, shape = parts[0][0], parts[0][1]
            assert all(q[0] == dt and q[1] == shape for q in parts)
            w[f"language_model.model.layers.{li}.mlp.switch_mlp.{proj}.weight"] = (
                dt, [E] + shape, b"".join(q[2] for q in parts))
    for k in list(w):
        dt, shape, b = w[k]
        if "conv1d.weight" in k and shape[-1] != 1:
            w[k] = (dt, [shape[0], shape[2], shape[1]], b)  # [C, 1, K] -> [C, K, 1]: same bytes
        if any(k.endswith(s) for s in ZERO_CENTRED) and len(shape) == 1:
            assert dt == "BF16", (k, dt)
            vals = to_f32_list(dt, b)
            w[k] = (dt, shape, array("H", bf16_bits(f32([1.0 + v for v in vals]))).tobytes())
    # 2. quantize_model: every Linear/Embedding/SwitchLinear weight (ndim >= 2, not conv1d).
    out = {}
    quant = {"group_size": GROUP, "bits": 4, "mode": "affine"}
    qinfo = {}  # mlx module -> bits (for the dequantised reference)
    for k in sorted(w):
        dt, shape, b = w[k]
        if not (k.endswith(".weight") and len(shape) >= 2 and "conv1d" not in k):
            out[k] = (dt, shape, b)
            continue
        module = k[:-len(".weight")]
        bits = module_bits(module, shape[-1])
        if bits == 0:
            out[k] = (dt, shape, b)
            continue
        words, scales, biases = quantize_rows(rows_of(to_f32_list(dt, b), shape[-1]), bits)
        lead = shape[:-1]
        out[module + ".weight"] = ("U32", lead + [shape[-1] * bits // 32], words.tobytes())
        out[module + ".scales"] = ("BF16", lead + [shape[-1] // GROUP], scales.tobytes())
        out[module + ".biases"] = ("BF16", lead + [shape[-1] // GROUP], biases.tobytes())
        qinfo[module] = bits
        if bits != 4:
            quant[module] = {"group_size": GROUP, "bits": bits}
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), out, {"format": "mlx"})
    total = sum(len(v[2]) for v in out.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {k: "model.safetensors" for k in sorted(out)}}
    json.dump(index, open(os.path.join(out_dir, "model.safetensors.index.json"), "w"), indent=4)
    cfg = dict(config)
    cfg.pop("vision_config", None)
    cfg["quantization"] = quant
    cfg["quantization_config"] = quant
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"), indent=4, sort_keys=True)
    # generation_config.json only: the tokenizer files are not duplicated into the committed
    # fixture (size); `kestrel quantize` copies them (tested in tests/quant).
    shutil.copy(os.path.join(src_dir, "generation_config.json"), out_dir)
    print(f"[mlx] wrote {out_dir}: {len(out)} tensors, {total} bytes, "
          f"{sum(1 for v in qinfo.values() if v == 8)} 8-bit modules, "
          f"{sum(1 for k, v in out.items() if k.endswith('.weight') and v[0] != 'U32' and len(v[1]) >= 2 and 'conv1d' not in k)} "
          f"matrices unquantized")
    return out, qinfo


# ---------------------------------------------------------------- parity vectors
def parity_vectors(path, seed=20261202):
    """A bf16 [16, 256] matrix with the corner cases, and its codes/scales/biases at 4 and 8 bits."""
    rng = random.Random(seed)
    R, C = 16, 256
    rows = []
    for r in range(R):
        if r == 0:
            row = [0.8125] * C                                   # constant group
        elif r == 1:
            row = [0.0] * C                                      # all zeros (eps path)
        elif r == 2:
            row = [-abs(rng.gauss(0, 1)) - 0.01 for _ in range(C)]  # all negative (w_max = 0)
        elif r == 3:
            row = [abs(rng.gauss(0, 1)) + 0.01 for _ in range(C)]   # all positive
        elif r == 4:
            row = [rng.gauss(0, 0.02) for _ in range(C)]
            row[5], row[70], row[200] = 3.0, -4.0, 2.5            # outliers
        elif r == 5:
            row = [rng.gauss(0, 1e-8) for _ in range(C)]         # tiny: q0 == 0 path
        elif r == 6:
            # ties: w_max 15, w_min 0 -> s = -1, bias 15; x.5 values hit round-half-away.
            base = [0.0, 15.0] + [k + 0.5 for k in range(15)] + [float(k) for k in range(16)]
            row = [base[j % len(base)] for j in range(C)]
        elif r == 7:
            row = [rng.uniform(-1, 1) * 10 ** rng.uniform(-3, 1) for _ in range(C)]
        else:
            row = [rng.gauss(0, 1) * (0.02 if r % 2 else 1.0) for _ in range(C)]
        rows.append(row)
    hb = bf16_bits([x for row in rows for x in row])
    vals = bf16_to_f32(hb)
    out = {"w": ("BF16", [R, C], array("H", hb).tobytes())}
    for bits in (4, 8):
        words, scales, biases = quantize_rows(rows_of(vals, C), bits)
        out[f"codes{bits}"] = ("U32", [R, C * bits // 32], words.tobytes())
        out[f"scales{bits}"] = ("BF16", [R, C // GROUP], scales.tobytes())
        out[f"biases{bits}"] = ("BF16", [R, C // GROUP], biases.tobytes())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_safetensors(path, out, {"format": "kestrel-quant-parity", "seed": str(seed)})
    print(f"[parity] wrote {path}")


# ---------------------------------------------------------------- reference (torch)
def dequantised_hf_dir(src_dir, qinfo, tmp):
    """The tiny HF checkpoint with every matrix the recipe quantizes replaced by its dequantised
    fp32 values and the zero-centred norms set to bf16(1+w) - 1 (what the MLX file holds)."""
    tensors, meta = read_safetensors(os.path.join(src_dir, "model.safetensors"))
    out = {}
    for k, (dt, shape, b) in tensors.items():
        if k.startswith("model.language_model.") or k == "lm_head.weight":
            m = mlx_name(k)
            module = m[:-len(".weight")] if m.endswith(".weight") else m
            if ".mlp.experts." in k:  # experts.{e}.{proj}.weight -> switch_mlp.{proj}
                parts = module.split(".")
                i = parts.index("experts")
                module = ".".join(parts[:i] + ["switch_mlp"] + parts[i + 2:])
            bits = qinfo.get(module, 0)
            if bits:
                vals = to_f32_list(dt, b)
                words, sc, bi = quantize_rows(rows_of(vals, shape[-1]), bits)
                n = len(vals) // shape[-1]
                deq = dequantize_rows(words, sc, bi, n, shape[-1], bits)
                out[k] = ("F32", shape, array("f", deq).tobytes())
                continue
            if any(m.endswith(s) for s in ZERO_CENTRED) and len(shape) == 1:
                vals = to_f32_list(dt, b)
                baked = bf16_to_f32(bf16_bits(f32([1.0 + v for v in vals])))
                out[k] = ("F32", shape, array("f", f32([x - 1.0 for x in baked])).tobytes())
                continue
        out[k] = (dt, shape, b)
    write_safetensors(os.path.join(tmp, "model.safetensors"), out, meta or {"format": "pt"})
    for f in os.listdir(src_dir):
        if f.endswith(".json"):
            shutil.copy(os.path.join(src_dir, f), os.path.join(tmp, f))


def reference(src_dir, out_dir, qinfo):
    import torch
    from safetensors.torch import load_file, save_file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import make_fixtures
    torch.set_num_threads(min(16, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        dequantised_hf_dir(src_dir, qinfo, tmp)
        ref = make_fixtures.reference(tmp)
    base = load_file(os.path.join(src_dir, "reference.safetensors"))
    assert torch.equal(base["prompt_ids"], ref["prompt_ids"]), "prompt differs from tiny's"
    d = (ref["prompt_logits"] - base["prompt_logits"]).abs().max() / base["prompt_logits"].abs().max()
    print(f"[reference] q4 vs bf16 prompt logits: max rel diff {float(d):.4f} (quantization effect); "
          f"greedy q4 {ref['greedy_tokens'].tolist()} bf16 {base['greedy_tokens'].tolist()}")
    save_file(ref, os.path.join(out_dir, "reference.safetensors"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="tests/fixtures/tiny")
    ap.add_argument("--out", default="tests/fixtures/tiny-mlx4")
    ap.add_argument("--parity", default="tests/fixtures/quant/parity.safetensors")
    ap.add_argument("--reference", action="store_true", help="also write reference.safetensors (torch)")
    a = ap.parse_args()
    parity_vectors(a.parity)
    _, qinfo = convert(a.src, a.out)
    if a.reference:
        reference(a.src, a.out, qinfo)


if __name__ == "__main__":
    sys.exit(main())
