// Prefill (many-token) kernels of the CUDA backend: tensor-core GEMM with the weight dequantised
// while tiles are staged into shared memory (BF16 / MLX affine Q4 / Q8 DMat), the grouped MoE
// pipeline (GPU routing, expert-sorted token slots, gate|up with SiLU*up epilogue, down with the
// routing weight, deterministic combine), chunked Gated DeltaNet, causal flash attention.
//
// Plain C++ interface (includable from .cpp and .cu). The *_launch functions are the raw launches
// (no validation), implemented in prefill_*.cu. Callers outside the .cu files use the validated
// wrappers at the end (prefill_gemm, moe_route, ...), which KESTREL_CHECK every precondition; they
// are compiled by the host compiler only (nvcc cannot compile fmt 9's consteval format checks).
//
// Activations are fp32 (the CPU oracle's precision). The GEMM keeps quantised weights as exact
// integers and takes fp32 activations either as two bf16 parts (hi + lo: the oracle's numbers to
// accumulation order) or as one fp16 plane (PrefillAPrec; see prefill_gemm.cu); attention always
// splits q and P into hi + lo (an fp16 attention measured slower: its K/V conversion in the
// staging cost more than the halved MMAs saved); accumulation fp32. Nothing here synchronises the host: every entry point is
// asynchronous on its stream and graph-capturable (grid sizes depend only on host-known bounds).
#pragma once
#include "cuda/kernels.h"

#include <cstdint>

namespace kestrel::cuda {

// ---------------------------------------------------------------------------------------------
// Fused-dequant GEMM: C[m, n] (op)= sum_k A[a_row(m), k] * W[w_row(n), k].
enum class GemmEpi : uint8_t {
  Store,     // C[c_row(m), n] = scale(m) * acc
  Residual,  // C[c_row(m), n] += scale(m) * acc
  SiluMul,   // C[c_row(m), n] = scale(m) * silu(A W_gate^T)[m, n] * (A W_up^T)[m, n]  (W2 = up)
};

constexpr int kPrefillBM = 64;  // rows per tile of the grouped GEMM (moe_route's tile prefix)
                                // on the Split route; the F16 route's default is 128

// How an fp32 A reaches the tensor cores (an explicit route, chosen by the caller):
//   Split: two bf16 planes hi = bf16(a), lo = bf16(a - hi), both multiplied (a = hi + lo to about
//          2^-17 relative: the fp32 oracle's numbers up to accumulation order; 2 MMAs per tile);
//   F16:   one fp16 plane (2^-11 relative rounding, 1 MMA per tile); W is staged as fp16 too
//          (Q4/Q8 integers exactly; bf16 weights exactly for |w| >= 2^-14, the rest as fp16
//          subnormals). Finite |a| > 65504 does not fit fp16: such an element is staged as
//          +-65504 and sets *range_flag, so that the caller can redo the work with Split.
enum class PrefillAPrec : uint8_t { Split, F16 };
constexpr float kF16Max = 65504.f;

// Which kernel runs a GEMM of fp32 A on the Split route (an explicit route, chosen by the caller):
//   Reg:  prefill_gemm.cu, A converted per tile while staged through registers (every format);
//   Pipe: prefill_pipe.cu, A split once per activation (prefill_pipe_split) and every operand
//         copied by cp.async into a 4-stage ring; the same numbers (hi + lo, exact integer Q4
//         weights folded in per group) up to accumulation order. Q4 and bf16 weights with
//         K % 512 == 0 only (prefill_pipe_supports); the caller gives the split A (PrefillGemmArgs::pipe).
enum class PrefillGemmKernel : uint8_t { Reg, Pipe };
// The Pipe kernel's tensor-core instruction for Q4 weights: wgmma (two warpgroups of 64 x 128,
// the default), wgmma warp-specialised (a producer warpgroup copying and converting, two consumer
// warpgroups on mbarriers: a fold overlaps the next tile's wgmma), wgmma transposed (C^T = W X^T with
// the dequantised weights as the register operand: no converted copy in shared memory, two scales
// per thread and k-tile) or mma.sync (8 warps of 32 x 64; bf16 weights always take it).
// KESTREL_PIPE_MMA = auto | wgmma | ws | rs | sync | dq | pp, read at each launch (so that tests
// cover every one); anything else is an error. Auto (the default): Pp where K >= 1024 (the GDN and
// attention projections, out/o_proj, the experts' gate|up), Wgmma below (the K = 512 down
// projections, whose 8 k-tiles are two of Pp's unrolled blocks: 913 against 873 us at 4K).
// Measured (H100, ABBA, bench/PREFILL_NOTES.md v15): Pp everywhere +1.2 % at 4K, +0.1 % at 32K.
// Dq (KESTREL_PIPE_MMA=dq) is a different contract, for Q4 and bf16 weights alike: A as its bf16
// hi plane only and the weights dequantised to bf16 in shared memory (Q4: bf16(q s + b)), one
// wgmma per k16 step accumulating the whole K (prefill_pipe.cu); a bf16 x bf16 GEMM's numbers.
// Opt-in only: +44 % at 4K, but the prompt logits miss the end-to-end bound against the fp32
// oracle (bench/PREFILL_NOTES.md v13), as the fp16-activation route did (v4).
// Pp (KESTREL_PIPE_MMA=pp, Q4): the exact numbers (as wgmma) in the Dq kernel's pipeline, each
// k-tile's integer products in one of two product sets, folded while the next k-tile's wgmma run.
enum class PipeMma : uint8_t { Auto, Wgmma, Ws, Rs, Sync, Dq, Pp };
PipeMma prefill_pipe_q4_mma();
// The kernel Auto takes for a Q4 GEMM of reduction length K (any other choice: itself).
inline PipeMma pipe_mma_for(PipeMma m, int64_t K) {
  return m != PipeMma::Auto ? m : K >= 1024 ? PipeMma::Pp : PipeMma::Wgmma;
}
// The Dq kernel's Q4 tiles: 128 x 128 (the default) or 128 x 256 (m64n256 per warpgroup).
// KESTREL_PIPE_DQ_N = 128 | 256; anything else is an error.
bool prefill_pipe_dq_wide();
// The Rs kernel's MoE tail tiles (PrefillGemmArgs::tail_off): an expert's last rows_g % 128 rows,
// when at most 64, on a 64-token tile (half the wgmma and activation copies of a 128-token one).
// KESTREL_PIPE_RS_TAIL = 0 (default) | 1; anything else is an error.
bool prefill_pipe_rs_tail();
// The warp-specialised kernel's grid: persistent (the default; one block per SM, each looping over
// tiles, so that the producer fills the ring for the next tile during the consumers' epilogue) or
// one block per tile. KESTREL_PIPE_WS_GRID = persistent | tiles.
enum class PipeWsGrid : uint8_t { Persistent, Tiles };
PipeWsGrid prefill_pipe_ws_grid();
inline const char* prefill_pipe_mma_name(PipeMma m) {
  return m == PipeMma::Auto ? "auto"
         : m == PipeMma::Wgmma ? "wgmma"
         : m == PipeMma::Ws  ? "ws"
         : m == PipeMma::Rs  ? "rs"
         : m == PipeMma::Sync ? "sync"
         : m == PipeMma::Dq   ? "dq"
                              : "pp";
}
constexpr int kPipeBM = 128;  // rows per tile of the Pipe kernel (grouped: moe_route's bm)
constexpr int kPipeTailRows = 64;  // the rs kernel's MoE tail tiles (prefill_pipe_rs_tail)
inline bool prefill_pipe_supports(DFmt f, int64_t K) {
  return (f == DFmt::Q4 || f == DFmt::BF16) && K % 512 == 0;
}
// An fp32 A [rows, K] split for the Pipe kernel: bf16 planes hi = bf16(a), lo = bf16(a - hi), each
// [rows, K] with k permuted within every 32 (see prefill_pipe.cu), and sum [rows, K / 64], the fp32
// sum of a over each 64-group (the Q4 fold's b * sum(A)).
struct PipeA {
  const uint16_t* hi = nullptr;
  const uint16_t* lo = nullptr;
  const float* sum = nullptr;
  int64_t rows = 0, K = 0;
  bool valid() const { return hi != nullptr; }
};
// lo = sum = nullptr: the hi plane only (all the Dq kernel reads).
struct PipeSplitArgs {
  const float* A = nullptr;  // fp32 [rows, lda]
  int64_t rows = 0, K = 0, lda = 0;
  uint16_t* hi = nullptr;    // [rows, K]
  uint16_t* lo = nullptr;    // [rows, K]
  float* sum = nullptr;      // [rows, K / 64]
  PipeA planes() const { return PipeA{hi, lo, sum, rows, K}; }  // what the GEMMs read
};
void prefill_pipe_split_launch(const PipeSplitArgs& a, cudaStream_t s);
void prefill_pipe_init();

// Row groups (grouped / MoE GEMM): group g covers rows [group_off[g], group_off[g+1]) of the
// (sorted) row space and uses weight rows [g * N, (g+1) * N) of W (and W2); tile_off[g] is the
// prefix of ceil(rows_g / bm) over groups (device arrays, built by moe_route for bm = kPrefillBM).
struct PrefillGemmArgs {
  int64_t M = 0;              // rows (dense), or an upper bound on sum of group rows (grouped)
  int64_t N = 0, K = 0;       // per-group output width, reduction length (K % 64 == 0)
  const float* A = nullptr;   // fp32 [*, lda] (staged as `aprec` says), or
  const uint16_t* A16 = nullptr;  // bf16 [*, lda] (the same numbers at half the bytes), or
  PipeA pipe;                     // the fp32 A split for the Pipe kernel (rows indexed as A's)
  int64_t lda = 0;
  PrefillAPrec aprec = PrefillAPrec::Split;  // fp32 A only
  unsigned* range_flag = nullptr;  // F16: device word, |= 1 when an A element exceeded f16_limit
  float f16_limit = kF16Max;       // F16: clamp bound (kF16Max; lower only in tests of the redo)
  const int* a_rows = nullptr;  // optional [M]: A row of row m (gather), a_rows[m] / a_div
  int a_div = 1;                // gather divisor (slot id -> token: topk)
  DMat W;                       // [groups * N, K]
  DMat W2;                      // SiluMul: up, same shape/format as W
  GemmEpi epi = GemmEpi::Store;
  float* C = nullptr;           // fp32 [*, ldc], or
  uint16_t* C16 = nullptr;      // bf16 [*, ldc] (Store / SiluMul only)
  int64_t ldc = 0;
  const int* c_rows = nullptr;  // optional [M]: C row of row m (scatter)
  const float* row_scale = nullptr;  // optional: scale(m) = row_scale[c_row(m)]
  // grouped
  int groups = 0;                  // 0: dense; else number of groups (experts)
  const int* group_off = nullptr;  // device [groups + 1]
  const int* tile_off = nullptr;   // device [groups + 1]
  int max_tiles = 0;               // host bound on tile_off[groups]
  int group_bm = kPrefillBM;       // rows per tile tile_off counts (64, or 128 on the F16 route)
  // Optional (the transposed Q4 kernel only, PipeMma::Rs): device [groups + 1], the prefix of the
  // groups' tail tiles, a remainder of rows_g % kPipeBM of at most 64 rows, which tile_off then
  // leaves out (moe_route with tail_rows = 64); those run on 64-token tiles.
  const int* tail_off = nullptr;
};
// out[r, c] = bf16(x[r, c]) for rows x cols (ldx, ldo in elements; cols % 8 == 0).
void prefill_to_bf16_launch(const float* x, int64_t rows, int64_t cols, int64_t ldx, uint16_t* out,
                            int64_t ldo, cudaStream_t s);
void prefill_gemm_init();       // one-time kernel attributes (large shared memory)
void prefill_gemm_launch(const PrefillGemmArgs& a, cudaStream_t s);
void prefill_pipe_gemm_launch(const PrefillGemmArgs& a, cudaStream_t s);  // a.pipe given

// ---------------------------------------------------------------------------------------------
// MoE routing on the GPU. logits fp32 [T, E] (router GEMM output). Per token: fp32 softmax,
// top-k (descending, lower index first on ties, as the CPU oracle), renormalised weights. The k
// selections of a token are stored in ascending expert order (the reference's accumulation order):
// slot s = t * topk + r. Then the slots are counted and sorted by expert:
//   counts[e], group_off[e] (exclusive prefix, group_off[E] = T*topk), tile_off[e] (prefix of
//   ceil(count/kPrefillBM)), sorted[p] = slot id of sorted position p (within an expert in
//   ascending slot order: deterministic).
struct MoeRouteArgs {
  const float* logits = nullptr;
  int64_t T = 0;
  int E = 0, topk = 0;
  int* topk_idx = nullptr;    // [T * topk]
  float* topk_w = nullptr;    // [T * topk]
  int* counts = nullptr;      // [E]
  int* group_off = nullptr;   // [E + 1]
  int* tile_off = nullptr;    // [E + 1]
  int* sorted = nullptr;      // [T * topk]
  int bm = kPrefillBM;        // rows per tile of tile_off (64 or 128)
  // tail_rows > 0 (with bm 128): a remainder count % bm of at most tail_rows rows is a tail tile,
  // counted in tail_off [E + 1] (prefix) instead of tile_off.
  int* tail_off = nullptr;
  int tail_rows = 0;
};
void moe_route_launch(const MoeRouteArgs& a, cudaStream_t s);
// Host bound on tile_off[E] for T tokens: ceil(T*topk / bm) + E.
inline int moe_max_tiles(int64_t T, int topk, int E, int bm = kPrefillBM) {
  return int((T * topk + bm - 1) / bm) + E;
}

// Combine: out[t, :] (+)= sum_r slot_out[t*topk + r, :] (r ascending = expert ascending)
//          + sigmoid(sgate[t]) * shared[t, :]   (shared and sgate optional).
struct MoeCombineArgs {
  int64_t T = 0, hidden = 0;
  int topk = 0;
  const float* slot_out = nullptr;  // [T * topk, hidden]
  const float* shared = nullptr;    // [T, hidden] or null
  const float* sgate = nullptr;     // [T] shared_expert_gate logits, or null (weight 1)
  float* out = nullptr;             // [T, hidden]
  bool accumulate = false;          // out += (residual) instead of out =
};
void moe_combine_launch(const MoeCombineArgs& a, cudaStream_t s);

// The whole sparse-MoE block for T tokens (routed experts + shared expert), all on the GPU.
// Scratch sizes: see MoePrefillScratch::bytes.
struct MoePrefillWeights {
  DMat router;                 // [E, hidden]
  DMat gate, up;               // stacked [E*I, hidden]
  DMat down;                   // stacked [E*hidden, I]
  DMat shared_gate, shared_up; // [Is, hidden]
  DMat shared_down;            // [hidden, Is]
  DMat shared_expert_gate;     // [1, hidden]
  int E = 0, topk = 0;
  int64_t hidden = 0, I = 0, Is = 0;
};
struct MoePrefillScratch {
  float* logits = nullptr;    // [T, E]
  int* topk_idx = nullptr;    // [T*topk]
  float* topk_w = nullptr;    // [T*topk]
  int* counts = nullptr;      // [E]
  int* group_off = nullptr;   // [E+1]
  int* tile_off = nullptr;    // [E+1]
  int* tail_off = nullptr;    // [E+1], optional: the Rs kernel's tail tiles (prefill_pipe_rs_tail)
  int* sorted = nullptr;      // [T*topk]
  float* act = nullptr;       // [T*topk, I]
  float* slot_out = nullptr;  // [T*topk, hidden]
  float* sact = nullptr;      // [T, Is]
  float* shared = nullptr;    // [T, hidden]
  float* sgate = nullptr;     // [T]
  // true: `logits` already holds the router logits [T, E] (the prompt driver computes them with
  // the exact fp32 GEMM of prefill_ops.h, so routing matches decode and the CPU oracle); the
  // bf16 tensor-core router GEMM is skipped.
  bool router_logits_given = false;
  PrefillAPrec aprec = PrefillAPrec::Split;  // route of every GEMM of the block (see PrefillGemmArgs)
  unsigned* range_flag = nullptr;
  float f16_limit = kF16Max;
  // Rows per tile of the grouped expert GEMMs: 0 = the route's default (Split 64, F16 128: a
  // tile's dequantised W then serves twice the rows); 64 or 128 explicitly (128 needs F16).
  int moe_bm = 0;
  // Pipe: every GEMM of the block whose weights the Pipe kernel takes (prefill_pipe_supports; the
  // routed experts only if both gate|up and down qualify, then with kPipeBM-row tiles) runs there,
  // on A split into pipe[0] (h, then the shared expert's activation: [T, max(hidden, Is)]) and
  // pipe[1] (the routed activation: [T*topk, I]); Split route only.
  PrefillGemmKernel kernel = PrefillGemmKernel::Reg;
  struct PipeBuf {
    uint16_t* hi = nullptr;  // [elems]
    uint16_t* lo = nullptr;  // [elems]
    float* sum = nullptr;    // [elems / 64]
    int64_t elems = 0;
  } pipe[2];
};

// out[T, hidden] = MoE(h) (accumulate: out += MoE(h), the residual add).
void moe_prefill_launch(const MoePrefillWeights& w, const float* h, int64_t T,
                        const MoePrefillScratch& sc, float* out, bool accumulate, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// Gated DeltaNet prefill of T tokens of one sequence (chunk 64, fp32 state between chunks).
// Conv: x pre-conv fp32 [T, ldx] (C channels), w fp32 [C, 4] (tap 3 = current token), state fp32
// [C, 3] pre-conv history oldest first (the decode layout), updated; u fp32 [T, C] = SiLU(conv).
struct PrefillConvArgs {
  int64_t T = 0, C = 0;
  const float* x = nullptr;
  int64_t ldx = 0;
  const float* w = nullptr;
  float* state = nullptr;
  float* u = nullptr;  // [T, C]; must not alias x
};
void prefill_conv_launch(const PrefillConvArgs& a, cudaStream_t s);

// Chunked delta rule (two kernels: the chunk products for all chunks in parallel, then the
// sequential scan over chunks with the state in shared memory). u: post-conv fp32 [T, ldu] holding q (Hk*dk) | k (Hk*dk) | v (Hv*dv), raw
// (L2-normalised here, q also scaled by dk^-1/2); b, a: fp32 raw projections [T, ldb/lda];
// beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias). state fp32 [Hv, dv, dk] (decode's
// layout), updated; o fp32 [T, Hv*dv]. Widths: dk = dv = 128, Hv % Hk == 0.
struct PrefillGdnArgs {
  int64_t T = 0;
  const float* u = nullptr;
  int64_t ldu = 0;
  const float* b = nullptr;
  const float* a = nullptr;
  int64_t ldb = 0, lda = 0;
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  float* state = nullptr;
  float* o = nullptr;
  float* scratch = nullptr;  // prefill_gdn_scratch_bytes(T, Hv) bytes (16-byte aligned)
  int Hk = 0, Hv = 0, dk = 0, dv = 0;
};
constexpr int kGdnChunk = 64;
// Scratch of the chunk products (W, U, q exp(G), k exp(G_last - G), P, exp(G_last)): about
// 4 * 2304 * Hv bytes per token (302 MB for 4096 tokens at Hv = 32).
size_t prefill_gdn_scratch_bytes(int64_t T, int Hv);
void prefill_gdn_init();
void prefill_gdn_launch(const PrefillGdnArgs& a, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// Causal flash attention of T new tokens at positions pos0..pos0+T-1 (head dim 256, GQA).
// Prep: qg fp32 [T, heads*2D] raw q_proj (query then gate per head), k, v fp32 [T, kv_heads*D];
// q/k RMSNorm (effective weights) + NeoX RoPE on the first rotary_dim dims at position pos0+t;
// q (as bf16 hi + lo parts, [2, T, heads, D]) to qbuf, k (normed, roped) and v to the bf16 caches
// [capacity, kv_heads, D] at rows pos0..pos0+T-1.
// Attention: out[t, h, :] = softmax(q k^T / sqrt(D)) v over keys 0..pos0+t, times sigmoid(gate)
// when gated; fp32 [T, heads*D].
struct PrefillAttnArgs {
  int64_t T = 0, pos0 = 0, capacity = 0;
  const float* qg = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t ld = 0;               // row stride of qg, k and v (one buffer); 0: each dense at its own width
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float eps = 1e-6f;
  double rope_theta = 1e7;
  uint16_t* qbuf = nullptr;     // bf16 [2, T, heads, D] scratch: q's hi parts, then its lo parts
  uint16_t* kcache = nullptr;   // bf16 [capacity, kv_heads, D]
  uint16_t* vcache = nullptr;
  float* out = nullptr;         // fp32 [T, heads*D]
  bool gated = true;
  bool p_split = false;         // P V with P as bf16 hi + lo; false: P one bf16 plane (default)
  bool qk_wgmma = true;         // Q K^T on wgmma (default); false: mma.sync (and P V too)
  bool pv_wgmma = true;         // P V on wgmma (default, with qk_wgmma); false: mma.sync
  int wide = 0;                 // 1: 128-query blocks of two warpgroups, 64-key tiles (needs both
                                // products on wgmma and P as one plane); 2: the same with two K
                                // buffers; 0: 64 x 32 tiles (every route)
  int heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
};
// KESTREL_ATTN_P = bf16 (default) | split: the prompt step's p_split (read when it is built). bf16 P: ~2^-9 relative per
// attention weight, the same end-to-end logits error as split in every e2e test (bench/PREFILL_NOTES.md
// v10), +7.5 % at 128K.
bool prefill_attn_p_split();
// KESTREL_ATTN_QK = wgmma (default) | sync: the prompt step's qk_wgmma.
bool prefill_attn_qk_wgmma();
// KESTREL_ATTN_PV = wgmma (default) | sync: the prompt step's pv_wgmma.
bool prefill_attn_pv_wgmma();
// KESTREL_ATTN_TILE = 64x32 (default) | 128x64 | 128x64k2: the prompt step's wide, 0 | 1 | 2
// (bench/PREFILL_NOTES.md v17); the wide kernel has one route, so 128x64 with KESTREL_ATTN_P=split
// or a mma.sync product is an error.
int prefill_attn_wide();
void prefill_attn_init();
void prefill_attn_prep_launch(const PrefillAttnArgs& a, cudaStream_t s);
void prefill_attn_launch(const PrefillAttnArgs& a, cudaStream_t s);

}  // namespace kestrel::cuda

#ifndef __CUDACC__
#include "core/check.h"
#include <algorithm>
#include <string>

namespace kestrel::cuda {

inline bool al16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline void prefill_check_mat(const DMat& w, int64_t rows, int64_t K, const char* what) {
  KESTREL_CHECK(w.valid(), "{}: weight missing", what);
  KESTREL_CHECK(w.cols == K && w.rows >= rows, "{}: weight is [{}, {}], need >= [{}, {}]", what,
                w.rows, w.cols, rows, K);
  KESTREL_CHECK(w.fmt == DFmt::BF16 || w.fmt == DFmt::Q4 || w.fmt == DFmt::Q8,
                "{}: weight format {} (BF16, Q4, Q8 supported)", what, dfmt_name(w.fmt));
  if (w.fmt != DFmt::BF16)
    KESTREL_CHECK(w.group == 64 && w.scales && w.biases,
                  "{}: affine group {} with scales/biases needed (group 64)", what, w.group);
  KESTREL_CHECK((reinterpret_cast<uintptr_t>(w.data) & 15) == 0, "{}: weight data not 16-byte aligned",
                what);
}

// Validated fused-dequant GEMM.
inline void prefill_gemm(const PrefillGemmArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.M >= 0 && a.N >= 1 && a.K >= 64 && a.K % 64 == 0,
                "prefill_gemm: M {} N {} K {} (K a multiple of 64 needed)", a.M, a.N, a.K);
  const bool pipe = a.pipe.valid();
  KESTREL_CHECK(int(a.A != nullptr) + int(a.A16 != nullptr) + int(pipe) == 1,
                "prefill_gemm: give exactly one of A, A16, pipe");
  if (!pipe)
    KESTREL_CHECK(a.lda >= a.K && a.lda % 8 == 0 &&
                      (reinterpret_cast<uintptr_t>(a.A ? static_cast<const void*>(a.A)
                                                       : static_cast<const void*>(a.A16)) & 15) == 0,
                  "prefill_gemm: lda {} < K {}, lda not a multiple of 8 or A not 16-byte aligned",
                  a.lda, a.K);
  KESTREL_CHECK((a.C != nullptr) != (a.C16 != nullptr), "prefill_gemm: give exactly one of C, C16");
  KESTREL_CHECK(a.ldc >= a.N && (reinterpret_cast<uintptr_t>(a.C ? static_cast<void*>(a.C)
                                                                 : static_cast<void*>(a.C16)) & 3) == 0,
                "prefill_gemm: ldc {} < N {} or C not 4-byte aligned", a.ldc, a.N);
  KESTREL_CHECK(!(a.C16 && a.epi == GemmEpi::Residual), "prefill_gemm: Residual needs fp32 C");
  KESTREL_CHECK(a.a_div >= 1, "prefill_gemm: a_div {}", a.a_div);
  KESTREL_CHECK(a.aprec == PrefillAPrec::Split || (a.A != nullptr && a.range_flag != nullptr),
                "prefill_gemm: the F16 route needs an fp32 A and a range flag");
  KESTREL_CHECK(a.f16_limit > 0.f && a.f16_limit <= kF16Max, "prefill_gemm: f16_limit {}", std::to_string(a.f16_limit));
  const int64_t g = a.groups > 0 ? a.groups : 1;
  prefill_check_mat(a.W, g * a.N, a.K, "prefill_gemm W");
  if (a.epi == GemmEpi::SiluMul) {
    prefill_check_mat(a.W2, g * a.N, a.K, "prefill_gemm W2 (up)");
    KESTREL_CHECK(a.W2.fmt == a.W.fmt, "prefill_gemm: gate {} and up {} formats differ",
                  dfmt_name(a.W.fmt), dfmt_name(a.W2.fmt));
  }
  if (pipe) {
    KESTREL_CHECK(prefill_pipe_supports(a.W.fmt, a.K),
                  "prefill_gemm: the Pipe kernel takes Q4 or bf16 weights with K % 512 == 0 (W {}, K {})",
                  dfmt_name(a.W.fmt), a.K);
    const bool dq = prefill_pipe_q4_mma() == PipeMma::Dq;  // (hi plane only)
    KESTREL_CHECK(a.pipe.K == a.K && (dq || (a.pipe.lo && (a.W.fmt != DFmt::Q4 || a.pipe.sum))) &&
                      al16(a.pipe.hi) && al16(a.pipe.lo) && al16(a.pipe.sum),
                  "prefill_gemm: split A of K {} for K {}, a plane or the sums missing or not 16-byte "
                  "aligned", a.pipe.K, a.K);
    KESTREL_CHECK(a.aprec == PrefillAPrec::Split, "prefill_gemm: the Pipe kernel is the Split route");
    KESTREL_CHECK(a.W.aligned16() && (a.epi != GemmEpi::SiluMul || a.W2.aligned16()),
                  "prefill_gemm: the Pipe kernel's weight copies need 16-byte aligned codes, scales, biases");
    KESTREL_CHECK(a.groups == 0 || a.group_bm == kPipeBM,
                  "prefill_gemm: grouped Pipe tiles are {} rows (route with bm {})", kPipeBM, a.group_bm);
  }
  if (a.groups > 0) {
    KESTREL_CHECK(a.group_off && a.tile_off && a.max_tiles >= 0 && a.max_tiles < 65536,
                  "prefill_gemm: grouped GEMM needs group_off, tile_off and 0 <= max_tiles {} < 65536",
                  a.max_tiles);
    KESTREL_CHECK(pipe || a.group_bm == 64 || (a.group_bm == 128 && (a.W.fmt == DFmt::BF16 ||
                                                             (a.A && a.aprec == PrefillAPrec::F16))),
                  "prefill_gemm: grouped tiles of {} rows (64, or 128 with bf16 W or the F16 route)",
                  a.group_bm);
  }
  else
    KESTREL_CHECK(a.M < int64_t(65535) * 128, "prefill_gemm: M {} too large", a.M);
  KESTREL_CHECK(!a.tail_off || (pipe && a.groups > 0 && a.W.fmt == DFmt::Q4 && prefill_pipe_q4_mma() == PipeMma::Rs),
                "prefill_gemm: tail tiles (tail_off) are the grouped Q4 Pipe GEMM's on the rs kernel only");
  if (a.M == 0 || (a.groups > 0 && a.max_tiles == 0)) return;
  if (pipe) prefill_pipe_gemm_launch(a, s);
  else prefill_gemm_launch(a, s);
}

// Validated split of an fp32 A for the Pipe kernel.
inline PipeA prefill_pipe_split(const PipeSplitArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.rows >= 0 && a.K >= 64 && a.K % 64 == 0 && a.lda >= a.K && a.lda % 4 == 0,
                "prefill_pipe_split: rows {} K {} lda {} (K a multiple of 64)", a.rows, a.K, a.lda);
  KESTREL_CHECK(a.A && a.hi && (a.lo == nullptr) == (a.sum == nullptr) && al16(a.A) && al16(a.hi) &&
                    al16(a.lo) && al16(a.sum),
                "prefill_pipe_split: null or not 16-byte aligned buffer (lo and sum: both or neither)");
  if (a.rows > 0) prefill_pipe_split_launch(a, s);
  return a.planes();
}

inline void moe_route(const MoeRouteArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.T >= 1 && a.E >= 1 && a.E <= 1024 && a.topk >= 1 && a.topk <= 16 && a.topk <= a.E,
                "moe_route: T {} E {} topk {} (E <= 1024, topk <= 16)", a.T, a.E, a.topk);
  KESTREL_CHECK(a.logits && a.topk_idx && a.topk_w && a.counts && a.group_off && a.tile_off &&
                    a.sorted,
                "moe_route: null buffer");
  KESTREL_CHECK(a.T * a.topk < (int64_t(1) << 30), "moe_route: T {} too large", a.T);
  KESTREL_CHECK(a.bm == 64 || a.bm == 128, "moe_route: tile of {} rows (64 or 128)", a.bm);
  KESTREL_CHECK(a.tail_rows == 0 || (a.tail_off && a.bm == kPipeBM && a.tail_rows == kPipeTailRows),
                "moe_route: tail tiles of {} rows need tail_off and 128-row tiles (64 rows)", a.tail_rows);
  moe_route_launch(a, s);
}

inline void moe_combine(const MoeCombineArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.T >= 1 && a.hidden >= 1 && a.hidden % 4 == 0 && a.topk >= 1,
                "moe_combine: T {} hidden {} topk {}", a.T, a.hidden, a.topk);
  KESTREL_CHECK(a.slot_out && a.out, "moe_combine: null buffer");
  moe_combine_launch(a, s);
}

inline void moe_prefill(const MoePrefillWeights& w, const float* h, int64_t T,
                        const MoePrefillScratch& sc, float* out, bool accumulate, cudaStream_t s) {
  KESTREL_CHECK(T >= 1 && w.E >= 1 && w.topk >= 1 && w.topk <= w.E && w.hidden % 64 == 0 &&
                    w.I % 64 == 0 && w.Is % 64 == 0,
                "moe_prefill: T {} E {} topk {} hidden {} I {} Is {}", T, w.E, w.topk, w.hidden, w.I,
                w.Is);
  KESTREL_CHECK(h && out, "moe_prefill: null input/output");
  if (sc.kernel == PrefillGemmKernel::Pipe)
    KESTREL_CHECK(sc.aprec == PrefillAPrec::Split && sc.pipe[0].hi && sc.pipe[1].hi &&
                      sc.pipe[0].elems >= T * std::max(w.hidden, w.Is) &&
                      sc.pipe[1].elems >= T * w.topk * w.I,
                  "moe_prefill: the Pipe kernel needs the Split route and split-A buffers of {} and {} "
                  "elements", T * std::max(w.hidden, w.Is), T * w.topk * w.I);
  if (sc.kernel == PrefillGemmKernel::Pipe)
    for (const DMat* m : {&w.router, &w.gate, &w.up, &w.down, &w.shared_gate, &w.shared_up, &w.shared_down,
                          &w.shared_expert_gate})
      KESTREL_CHECK(!m->valid() || m->aligned16(),
                    "moe_prefill: the Pipe kernel's weight copies need 16-byte aligned codes, scales, biases");
  KESTREL_CHECK(al16(h) && al16(out) && al16(sc.act) && al16(sc.slot_out) &&
                    (!sc.sact || al16(sc.sact)) && (!sc.shared || al16(sc.shared)),
                "moe_prefill: h, out and the scratch buffers must be 16-byte aligned");
  prefill_check_mat(w.router, w.E, w.hidden, "moe_prefill router");
  prefill_check_mat(w.gate, w.E * w.I, w.hidden, "moe_prefill gate");
  prefill_check_mat(w.up, w.E * w.I, w.hidden, "moe_prefill up");
  prefill_check_mat(w.down, w.E * w.hidden, w.I, "moe_prefill down");
  KESTREL_CHECK(w.gate.fmt == w.up.fmt, "moe_prefill: gate/up formats differ");
  const bool has_shared = w.shared_down.valid();
  if (has_shared) {
    prefill_check_mat(w.shared_gate, w.Is, w.hidden, "moe_prefill shared_gate");
    prefill_check_mat(w.shared_up, w.Is, w.hidden, "moe_prefill shared_up");
    prefill_check_mat(w.shared_down, w.hidden, w.Is, "moe_prefill shared_down");
    KESTREL_CHECK(w.shared_gate.fmt == w.shared_up.fmt, "moe_prefill: shared gate/up formats differ");
    KESTREL_CHECK(sc.sact && sc.shared, "moe_prefill: shared-expert scratch missing");
    KESTREL_CHECK(w.Is % 8 == 0, "moe_prefill: Is {} not a multiple of 8", w.Is);
    if (w.shared_expert_gate.valid()) {
      prefill_check_mat(w.shared_expert_gate, 1, w.hidden, "moe_prefill shared_expert_gate");
      KESTREL_CHECK(sc.sgate, "moe_prefill: sgate scratch missing");
    }
  }
  KESTREL_CHECK(sc.logits && sc.topk_idx && sc.topk_w && sc.counts && sc.group_off && sc.tile_off &&
                    sc.sorted && sc.act && sc.slot_out,
                "moe_prefill: scratch buffer missing");
  KESTREL_CHECK(moe_max_tiles(T, w.topk, w.E) < 65536, "moe_prefill: T {} too large for one call", T);
  KESTREL_CHECK(sc.moe_bm == 0 || sc.moe_bm == 64 || (sc.moe_bm == 128 && sc.aprec == PrefillAPrec::F16),
                "moe_prefill: expert tiles of {} rows (0 = default, 64, or 128 on the F16 route)", sc.moe_bm);
  KESTREL_CHECK(sc.aprec == PrefillAPrec::Split || sc.range_flag != nullptr,
                "moe_prefill: the F16 route needs a range flag");
  moe_prefill_launch(w, h, T, sc, out, accumulate, s);
}

inline void prefill_to_bf16(const float* x, int64_t rows, int64_t cols, int64_t ldx, uint16_t* out,
                            int64_t ldo, cudaStream_t s) {
  KESTREL_CHECK(x && out && rows >= 0 && cols % 8 == 0 && ldx % 4 == 0 && ldo % 8 == 0 &&
                    ldx >= cols && ldo >= cols && (reinterpret_cast<uintptr_t>(x) & 15) == 0 &&
                    (reinterpret_cast<uintptr_t>(out) & 15) == 0,
                "prefill_to_bf16: {} x {} (ldx {}, ldo {}) needs cols % 8, 16-byte alignment", rows,
                cols, ldx, ldo);
  if (rows > 0 && cols > 0) prefill_to_bf16_launch(x, rows, cols, ldx, out, ldo, s);
}

inline void prefill_conv(const PrefillConvArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.T >= 1 && a.C >= 1 && a.x && a.w && a.state && a.u && a.ldx >= a.C,
                "prefill_conv: T {} C {} ldx {} or null buffer", a.T, a.C, a.ldx);
  KESTREL_CHECK(static_cast<const void*>(a.u) != static_cast<const void*>(a.x),
                "prefill_conv: u must not alias x");
  KESTREL_CHECK(al16(a.w), "prefill_conv: conv weights not 16-byte aligned (read as float4 per channel)");
  prefill_conv_launch(a, s);
}

inline void prefill_gdn(const PrefillGdnArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.dk == 128 && a.dv == 128, "prefill_gdn: dk {} dv {} (kernel for 128 x 128)", a.dk,
                a.dv);
  KESTREL_CHECK(a.Hk >= 1 && a.Hv >= a.Hk && a.Hv % a.Hk == 0, "prefill_gdn: Hk {} Hv {}", a.Hk, a.Hv);
  KESTREL_CHECK(a.T >= 1 && a.u && a.b && a.a && a.A_log && a.dt_bias && a.state && a.o && a.scratch,
                "prefill_gdn: T {} or null buffer", a.T);
  KESTREL_CHECK((reinterpret_cast<uintptr_t>(a.scratch) & 15) == 0, "prefill_gdn: scratch not aligned");
  KESTREL_CHECK(a.ldu >= int64_t(2 * a.Hk * a.dk + a.Hv * a.dv) && a.ldu % 4 == 0 &&
                    (reinterpret_cast<uintptr_t>(a.u) & 15) == 0,
                "prefill_gdn: ldu {} (need >= {}, multiple of 4, 16-byte aligned u)", a.ldu,
                2 * a.Hk * a.dk + a.Hv * a.dv);
  KESTREL_CHECK(a.ldb >= a.Hv && a.lda >= a.Hv, "prefill_gdn: ldb {} lda {} < Hv {}", a.ldb, a.lda,
                a.Hv);
  prefill_gdn_launch(a, s);
}

inline void prefill_attn(const PrefillAttnArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.head_dim == 256, "prefill_attn: head_dim {} (kernel for 256)", a.head_dim);
  KESTREL_CHECK(a.kv_heads >= 1 && a.heads >= a.kv_heads && a.heads % a.kv_heads == 0,
                "prefill_attn: heads {} kv_heads {}", a.heads, a.kv_heads);
  KESTREL_CHECK(a.rotary_dim >= 2 && a.rotary_dim % 2 == 0 && a.rotary_dim <= a.head_dim,
                "prefill_attn: rotary_dim {}", a.rotary_dim);
  KESTREL_CHECK(a.T >= 1 && a.pos0 >= 0 && a.pos0 + a.T <= a.capacity,
                "prefill_attn: positions {}..{} exceed the cache capacity {}", a.pos0, a.pos0 + a.T,
                a.capacity);
  KESTREL_CHECK(a.qg && a.k && a.v && a.q_norm && a.k_norm && a.qbuf && a.kcache && a.vcache && a.out,
                "prefill_attn: null buffer");
  KESTREL_CHECK(a.ld == 0 || a.ld >= int64_t(a.heads) * 2 * a.head_dim,
                "prefill_attn: row stride {} narrower than q|gate ({})", a.ld,
                int64_t(a.heads) * 2 * a.head_dim);
  auto al = [](const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; };
  KESTREL_CHECK(al(a.qbuf, 16) && al(a.kcache, 16) && al(a.vcache, 16) && al(a.out, 8),
                "prefill_attn: qbuf/kcache/vcache need 16-byte, out 8-byte alignment");
  KESTREL_CHECK(a.wide >= 0 && a.wide <= 2, "prefill_attn: wide {} (0, 1 or 2)", a.wide);
  KESTREL_CHECK(!a.wide || (a.qk_wgmma && a.pv_wgmma && !a.p_split),
                "prefill_attn: the 128x64 kernel runs Q K^T and P V on wgmma with P as one bf16 plane "
                "(qk_wgmma {}, pv_wgmma {}, p_split {}); KESTREL_ATTN_TILE=64x32 has the other routes",
                a.qk_wgmma, a.pv_wgmma, a.p_split);
  prefill_attn_prep_launch(a, s);
  prefill_attn_launch(a, s);
}

// Call once before any graph capture (large dynamic shared memory attributes).
inline void prefill_init() {
  prefill_gemm_init();
  prefill_gdn_init();
  prefill_attn_init();
}

}  // namespace kestrel::cuda
#endif
