// The small multi-token kernels of the prompt (prefill) step that the tensor-core families of
// prefill.h do not cover: [T, n] RMSNorm, the GDN gated RMSNorm per head group, the embedding
// gather and the per-sequence bookkeeping at the end of a prompt, and an exact fp32 GEMM on CUDA
// cores (the MoE router: the decode GEMV's and the CPU oracle's numbers up to summation order, so
// routing choices do not flip on bf16 rounding; the last position's lm_head is the decode GEMV).
//
// Plain C++ interface (includable from .cpp and .cu). The *_launch functions are the raw launches
// (no validation) in prefill_norm.cu, prefill_tokens.cu and prefill_f32gemm.cu; callers use the
// validated wrappers at the end, compiled by the host compiler only. Every entry point is
// asynchronous on its stream and never synchronises the host.
#pragma once
#include "cuda/kernels.h"

#include <cstdint>

namespace kestrel::cuda {

// ---------------------------------------------------------------------------------------------
// RMSNorm of T rows of n: y[t, i] = x[t, i] * rsqrt(mean(x[t, :]^2) + eps) * w[i] (w: the effective
// multiplier, as cpu::rmsnorm). Outputs fp32 y [T, ldy] and/or bf16 y16 [T, ldy16] (at least one).
struct PrefillRmsNormArgs {
  int64_t T = 0, n = 0;
  const float* x = nullptr;
  int64_t ldx = 0;
  const float* w = nullptr;
  float eps = 1e-6f;
  float* y = nullptr;
  int64_t ldy = 0;
  uint16_t* y16 = nullptr;
  int64_t ldy16 = 0;
};
void prefill_rmsnorm_launch(const PrefillRmsNormArgs& a, cudaStream_t s);

// GDN output norm over rows of n (rows = T * Hv, each a v-head of one token; o, z dense [rows, n]):
// y = (w * rmsnorm(o)) * silu(z), as cpu::gated_rmsnorm. Outputs fp32 y and/or bf16 y16, dense
// [rows, n], and/or (hi set; n % 128 == 0) the Pipe kernel's split of y as one dense matrix of
// any width that is a multiple of n (prefill_pipe_split's hi, lo and sum planes, the same bits;
// lo = sum = nullptr: hi alone), so that out_proj's input needs no split launch.
struct PrefillGatedNormArgs {
  int64_t rows = 0, n = 0;
  const float* o = nullptr;
  const float* z = nullptr;  // dense like o, or (z_heads > 0) row r at z + (r / z_heads) * ldz + (r % z_heads) * n
  int64_t z_heads = 0, ldz = 0;
  const float* w = nullptr;  // [n]
  float eps = 1e-6f;
  float* y = nullptr;
  uint16_t* y16 = nullptr;
  uint16_t* hi = nullptr;
  uint16_t* lo = nullptr;
  float* sum = nullptr;
};
void prefill_gated_norm_launch(const PrefillGatedNormArgs& a, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// x[t, :] = embed[tokens[t], :] (fp32, dequantised exactly) for T tokens; x dense [T, embed.cols].
struct PrefillEmbedArgs {
  int64_t T = 0;
  const int32_t* tokens = nullptr;  // device [T]
  DMat embed;
  float* x = nullptr;
};
void prefill_embed_launch(const PrefillEmbedArgs& a, cudaStream_t s);

// End of a prompt of a sequence now holding `len` tokens (history[0..len) written): the device
// counters the decode step continues from, as if the last token had been decoded:
// *len_out = len, *pos = len - 1, *token = history[len - 1].
struct PrefillSeqEndArgs {
  int64_t len = 0;
  const int32_t* history = nullptr;
  int* len_out = nullptr;
  int* pos = nullptr;
  int32_t* token = nullptr;
};
void prefill_seq_end_launch(const PrefillSeqEndArgs& a, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// Exact fp32 GEMM: C[m, n] = sum_k A[m, k] * W[n, k], A fp32 [M, lda], W any DMat format
// dequantised exactly (q * scale + bias: the product of a bf16 scale and an 8-bit code is exact,
// so this is the CPU's value), fp32 accumulation, C fp32 [M, ldc]. For small T * N * K work where
// bf16 rounding must not change a discrete choice (router top-k, argmax). Two routes
// (prefill_f32gemm.cu): Tc, tensor cores with A as two tf32 halves and W exact (~2^-22 relative
// per term; K % 64 == 0), and Fma, one fmaf chain per output on CUDA cores.
enum class F32GemmRoute : uint8_t { Tc, Fma };
const char* f32gemm_route_name(F32GemmRoute r);
// KESTREL_ROUTER_GEMM = tc (default) | fma: the prompt step's router route (read when it is built).
F32GemmRoute prefill_router_route();
struct PrefillGemmF32Args {
  F32GemmRoute route = F32GemmRoute::Tc;
  int64_t M = 0, N = 0, K = 0;
  const float* A = nullptr;
  int64_t lda = 0;
  DMat W;
  float* C = nullptr;
  int64_t ldc = 0;
};
void prefill_gemm_f32_launch(const PrefillGemmF32Args& a, cudaStream_t s);

}  // namespace kestrel::cuda

#ifndef __CUDACC__
#include "core/check.h"

namespace kestrel::cuda {

namespace detail_ops {
inline bool al(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }
}  // namespace detail_ops

inline void prefill_rmsnorm(const PrefillRmsNormArgs& a, cudaStream_t s) {
  using detail_ops::al;
  KESTREL_CHECK(a.T >= 0 && a.n >= 4 && a.n % 4 == 0, "prefill_rmsnorm: T {} n {} (n a multiple of 4)",
                a.T, a.n);
  KESTREL_CHECK(a.x && a.w && (a.y || a.y16), "prefill_rmsnorm: null input, weight or no output");
  KESTREL_CHECK(a.ldx >= a.n && a.ldx % 4 == 0 && al(a.x, 16) && al(a.w, 16),
                "prefill_rmsnorm: ldx {} (>= n {}, multiple of 4) or x/w not 16-byte aligned", a.ldx,
                a.n);
  if (a.y)
    KESTREL_CHECK(a.ldy >= a.n && a.ldy % 4 == 0 && al(a.y, 16),
                  "prefill_rmsnorm: ldy {} (>= n {}, multiple of 4) or y not 16-byte aligned", a.ldy,
                  a.n);
  if (a.y16)
    KESTREL_CHECK(a.ldy16 >= a.n && a.ldy16 % 4 == 0 && al(a.y16, 8),
                  "prefill_rmsnorm: ldy16 {} (>= n {}, multiple of 4) or y16 not 8-byte aligned",
                  a.ldy16, a.n);
  KESTREL_CHECK(a.T < (int64_t(1) << 31), "prefill_rmsnorm: T {} too large", a.T);
  if (a.T > 0) prefill_rmsnorm_launch(a, s);
}

inline void prefill_gated_norm(const PrefillGatedNormArgs& a, cudaStream_t s) {
  using detail_ops::al;
  KESTREL_CHECK(a.rows >= 0 && a.n >= 4 && a.n % 4 == 0 && a.n <= 1024,
                "prefill_gated_norm: rows {} n {} (n a multiple of 4, <= 1024)", a.rows, a.n);
  KESTREL_CHECK(a.o && a.z && a.w && (a.y || a.y16 || a.hi), "prefill_gated_norm: null buffer or no output");
  KESTREL_CHECK(!a.hi || (a.n % 128 == 0 && (a.lo == nullptr) == (a.sum == nullptr) && al(a.hi, 16) &&
                          al(a.lo, 16) && al(a.sum, 16)),
                "prefill_gated_norm: the split planes need n % 128 == 0 (n {}), lo and sum both or "
                "neither, 16-byte alignment", a.n);
  KESTREL_CHECK(al(a.o, 16) && al(a.z, 16) && al(a.w, 16) && (!a.y || al(a.y, 16)) &&
                    (!a.y16 || al(a.y16, 8)),
                "prefill_gated_norm: o, z, w, y need 16-byte and y16 8-byte alignment");
  KESTREL_CHECK(a.z_heads == 0 || (a.z_heads > 0 && a.ldz >= a.z_heads * a.n && a.ldz % 4 == 0),
                "prefill_gated_norm: z_heads {} ldz {} (ldz >= z_heads * n = {}, a multiple of 4)",
                a.z_heads, a.ldz, a.z_heads * a.n);
  KESTREL_CHECK(a.rows / 8 < (int64_t(1) << 31), "prefill_gated_norm: {} rows too many", a.rows);
  if (a.rows > 0) prefill_gated_norm_launch(a, s);
}

inline void prefill_embed(const PrefillEmbedArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.T >= 0 && a.T < (int64_t(1) << 31) && a.tokens && a.x,
                "prefill_embed: T {} or null buffer", a.T);
  KESTREL_CHECK(a.embed.valid() && a.embed.cols >= 1, "prefill_embed: embedding missing");
  if (a.embed.fmt != DFmt::BF16)
    KESTREL_CHECK(a.embed.group >= 8 && a.embed.cols % a.embed.group == 0 && a.embed.scales &&
                      a.embed.biases,
                  "prefill_embed: affine embedding with group {} over {} columns (scales/biases "
                  "needed)",
                  a.embed.group, a.embed.cols);
  if (a.T > 0) prefill_embed_launch(a, s);
}

inline void prefill_seq_end(const PrefillSeqEndArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.len >= 1 && a.len < (int64_t(1) << 31), "prefill_seq_end: length {}", a.len);
  KESTREL_CHECK(a.history && a.len_out && a.pos && a.token, "prefill_seq_end: null buffer");
  prefill_seq_end_launch(a, s);
}

inline void prefill_gemm_f32(const PrefillGemmF32Args& a, cudaStream_t s) {
  using detail_ops::al;
  KESTREL_CHECK(a.M >= 0 && a.N >= 1 && a.K >= 32 && a.K % 32 == 0,
                "prefill_gemm_f32: M {} N {} K {} (K a multiple of 32)", a.M, a.N, a.K);
  KESTREL_CHECK(a.route == F32GemmRoute::Fma || a.K % 64 == 0,
                "prefill_gemm_f32 ({}): K {} not a multiple of 64", f32gemm_route_name(a.route), a.K);
  KESTREL_CHECK(a.A && a.C && a.lda >= a.K && a.lda % 4 == 0 && al(a.A, 16) && a.ldc >= a.N,
                "prefill_gemm_f32: lda {} (>= K {}, multiple of 4, A 16-byte aligned), ldc {} (>= N {})",
                a.lda, a.K, a.ldc, a.N);
  KESTREL_CHECK(a.W.valid() && a.W.cols == a.K && a.W.rows >= a.N,
                "prefill_gemm_f32: weight [{}, {}], need >= [{}, {}]", a.W.rows, a.W.cols, a.N, a.K);
  KESTREL_CHECK(a.W.fmt == DFmt::BF16 || a.W.fmt == DFmt::Q4 || a.W.fmt == DFmt::Q8,
                "prefill_gemm_f32: weight format {}", dfmt_name(a.W.fmt));
  if (a.W.fmt != DFmt::BF16)
    KESTREL_CHECK(a.W.group == 64 && a.W.scales && a.W.biases,
                  "prefill_gemm_f32: affine group {} with scales/biases needed (group 64)", a.W.group);
  KESTREL_CHECK(al(a.W.data, 16), "prefill_gemm_f32: weight data not 16-byte aligned");
  KESTREL_CHECK((a.M + 63) / 64 < 65536, "prefill_gemm_f32: M {} too large", a.M);
  if (a.M > 0) prefill_gemm_f32_launch(a, s);
}

}  // namespace kestrel::cuda
#endif
