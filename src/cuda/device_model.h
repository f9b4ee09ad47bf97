// The CUDA backend's device-side model and per-sequence state: plain structs of device pointers
// shared by the decode step (cuda_backend.cpp) and the prompt (prefill) driver. Everything here
// is allocated once (model load, sequence creation); nothing is allocated per step. Host-compiled
// .cpp files only (KESTREL_FAIL uses fmt, which nvcc cannot compile).
#pragma once
#include "core/check.h"
#include "core/config.h"
#include "cuda/kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

namespace kestrel::cuda {

// ---------------------------------------------------------------- device memory
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  DeviceArena(DeviceArena&& o) noexcept : ptrs_(std::move(o.ptrs_)), bytes_(o.bytes_) {
    o.ptrs_.clear();
    o.bytes_ = 0;
  }
  DeviceArena& operator=(DeviceArena&&) = delete;
  ~DeviceArena() {
    for (void* p : ptrs_) cudaFree(p);
  }
  void* alloc(size_t bytes) {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 16));
    if (e != cudaSuccess) {
      size_t fr = 0, tot = 0;
      cudaMemGetInfo(&fr, &tot);
      KESTREL_FAIL("cudaMalloc of {:.2f} GB failed ({}); {:.2f} GB free of {:.2f} GB",
                   double(bytes) / 1e9, cudaGetErrorString(e), double(fr) / 1e9, double(tot) / 1e9);
    }
    ptrs_.push_back(p);
    bytes_ += bytes;
    return p;
  }
  template <class T>
  T* alloc_n(size_t n) {
    return static_cast<T*>(alloc(n * sizeof(T)));
  }
  size_t bytes() const { return bytes_; }

 private:
  std::vector<void*> ptrs_;
  size_t bytes_ = 0;
};

// ---------------------------------------------------------------- the device model
struct DLayer {
  LayerKind kind = LayerKind::LinearAttention;
  float* input_norm = nullptr;  // fp32 [hidden]
  float* post_norm = nullptr;   // fp32 [hidden]
  // GDN. in_proj is in_proj_qkv|z|b|a stacked by rows (the prompt's one GEMM over h);
  // qkv, z, b, a are row blocks of it (the decode GEMV's segments).
  DMat in_proj, qkv, z, b, a, out;
  float* conv_w = nullptr;   // fp32 [conv_dim, 4]
  float* A_log = nullptr;    // fp32 [Hv]
  float* dt_bias = nullptr;  // fp32 [Hv]
  float* gnorm = nullptr;    // fp32 [dv]
  // attention. attn_in is q_proj|k_proj|v_proj stacked by rows (the prompt's one GEMM);
  // q, k, v are row blocks of it.
  DMat attn_in, q, k, v, o;
  float* q_norm = nullptr;   // fp32 [head_dim]
  float* k_norm = nullptr;
  // MoE (experts stacked: gate/up [E*I, hidden], down [E*hidden, I])
  DMat router, gate, up, down, sh_gate, sh_up, sh_down, sh_egate;
};

// Rows [r0, r0 + n) of m, as a matrix of its own (a view: nothing copied).
inline DMat row_block(const DMat& m, int64_t r0, int64_t n) {
  KESTREL_CHECK(r0 >= 0 && n >= 0 && r0 + n <= m.rows, "row_block: rows [{}, {}) of a {}-row matrix",
                r0, r0 + n, m.rows);
  DMat v = m;
  v.rows = n;
  v.data = static_cast<const uint8_t*>(m.data) + m.row_bytes() * size_t(r0);
  if (m.fmt != DFmt::BF16) {
    const size_t gpr = size_t(m.cols / m.group);
    v.scales = m.scales + gpr * size_t(r0);
    v.biases = m.biases + gpr * size_t(r0);
  }
  return v;
}
// The GDN in_proj's row blocks (qkv, z, b, a) set from d.in_proj.
inline void split_gdn_in_proj(DLayer& d, const ModelConfig& c) {
  const int64_t C = c.gdn_conv_dim(), VD = c.gdn_value_dim(), Hv = c.linear_num_value_heads;
  KESTREL_CHECK(d.in_proj.rows == C + VD + 2 * Hv, "GDN in_proj has {} rows, expected {}",
                d.in_proj.rows, C + VD + 2 * Hv);
  d.qkv = row_block(d.in_proj, 0, C);
  d.z = row_block(d.in_proj, C, VD);
  d.b = row_block(d.in_proj, C + VD, Hv);
  d.a = row_block(d.in_proj, C + VD + Hv, Hv);
}

// The attention layer's row blocks (q|gate, k, v) set from d.attn_in.
inline void split_attn_in(DLayer& d, const ModelConfig& c) {
  const int64_t QG = int64_t(c.num_attention_heads) * 2 * c.head_dim,
                KV = int64_t(c.num_kv_heads) * c.head_dim;
  KESTREL_CHECK(d.attn_in.rows == QG + 2 * KV, "attention q|k|v has {} rows, expected {}",
                d.attn_in.rows, QG + 2 * KV);
  d.q = row_block(d.attn_in, 0, QG);
  d.k = row_block(d.attn_in, QG, KV);
  d.v = row_block(d.attn_in, QG + KV, KV);
}

struct DModel {
  ModelConfig cfg;
  DMat embed, lm_head;
  float* final_norm = nullptr;
  std::vector<DLayer> layers;
  DeviceArena arena;
  double load_s = 0;
  size_t weight_bytes = 0;
};

// Per-sequence device state (allocated up front for `capacity` tokens).
struct DSeq {
  int64_t capacity = 0, length = 0;
  DeviceArena arena;
  int* d_pos = nullptr;        // position of the token being processed
  int* d_len = nullptr;        // tokens in the cache
  int32_t* d_token = nullptr;  // input token of the step
  int32_t* d_history = nullptr;  // [capacity] every input token
  std::vector<float*> conv;      // per layer (GDN): fp32 [conv_dim, 3]
  std::vector<float*> rec;       // per layer (GDN): fp32 [Hv, dv, dk]
  std::vector<uint16_t*> kc, vc;  // per layer (attention): bf16 [capacity, kv_heads, head_dim]
  int nsplit = 1;
  int32_t vocab_limit = 0;                // argmax over ids < this (0 = all) in the greedy graph
  cudaGraphExec_t graph = nullptr;        // greedy step
  cudaGraphExec_t graph_plain = nullptr;  // step with a host-given token
};

}  // namespace kestrel::cuda
