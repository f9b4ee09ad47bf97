// CPU reference ops, fp32 math. This is the oracle: the CUDA kernels are tested against these.
// Activations are fp32 row-major; weights are read through Mat (upcast/dequantised on the fly).
#pragma once
#include "core/weights.h"

#include <cstdint>

namespace kestrel::cpu {

// y[T, W.rows] = x[T, W.cols] * W^T, fp32 accumulation. Threads over output rows.
void matmul(const Mat& W, const float* x, int64_t T, float* y);

// y = x * rsqrt(mean(x^2) + eps) * w over the last dim n, for T rows. w is the effective multiplier
// (1+w for the zero-centred norms). In place allowed.
void rmsnorm(const float* x, const float* w, int64_t T, int64_t n, float eps, float* y);

// GDN output norm per v-head row of n: y = (rmsnorm(o) * w) * silu(z). rows = T * Hv.
void gated_rmsnorm(const float* o, const float* z, const float* w, int64_t rows, int64_t n,
                   float eps, float* y);

// Causal depthwise conv1d + SiLU. x: pre-conv [T, C]; w: [C, K] (tap K-1 = current token);
// state: [C, K-1] pre-conv history, oldest first (updated to the last K-1 inputs); u: [T, C].
void conv1d_silu(const float* x, int64_t T, int64_t C, int K, const float* w, float* state,
                 float* u);

struct GdnDims {
  int Hk = 0, Hv = 0, dk = 0, dv = 0;
};

// Gated delta rule over T tokens, v-head j reads q/k head j / (Hv/Hk).
// q, k: [T, Hk, dk], already L2-normalised (q also scaled by dk^-1/2); v: [T, Hv, dv];
// beta, g: [T, Hv] (g = log decay <= 0); S: [Hv, dk, dv] fp32 state, updated; o: [T, Hv, dv].
void gdn_recurrent(const GdnDims& d, int64_t T, const float* q, const float* k, const float* v,
                   const float* beta, const float* g, float* S, float* o);
// The chunked (WY) form of the same recurrence, as transformers' torch_chunk_gated_delta_rule.
void gdn_chunked(const GdnDims& d, int64_t T, const float* q, const float* k, const float* v,
                 const float* beta, const float* g, float* S, float* o, int chunk = 64);

// L2-normalise each row of n in place: x / sqrt(sum x^2 + eps), then * scale.
void l2norm_rows(float* x, int64_t rows, int64_t n, float eps, float scale);

// NeoX rotate-half RoPE on the first `rot` dims of each head; x: [T, heads, D], positions pos0+t.
void rope_neox(float* x, int64_t T, int heads, int D, int rot, int64_t pos0, double theta);

// Causal GQA attention of T new queries at positions pos0..pos0+T-1 over a cache holding
// pos0+T keys. q: [T, H, D]; kc, vc: [>= pos0+T, Hkv, D]; out: [T, H, D]. scale = D^-1/2.
void attention(const float* q, int64_t T, int64_t pos0, const float* kc, const float* vc, int H,
               int Hkv, int D, float* out);

// Sparse MoE block: router softmax (fp32), top-k, renormalise, SwiGLU experts, shared expert with
// sigmoid gate. h, out: [T, hidden].
void moe(const MoeWeights& w, const ModelConfig& cfg, const float* h, int64_t T, float* out);

inline float silu(float x) { return x / (1.f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

}  // namespace kestrel::cpu
