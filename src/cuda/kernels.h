// Host-side interface of the CUDA kernel families (plain C++, no CUDA syntax, so tests and the
// backend can include it): device weight views and one validated launcher per kernel.
// Launchers check every shape/format precondition with KESTREL_CHECK before they launch.
// Activations are fp32 (the CPU oracle's precision); the KV cache is bf16; GDN state fp32.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::cuda {

// Throws kestrel::Error naming the call and the CUDA error string.
void cuda_check(cudaError_t e, const char* what, const char* file, int line);
#define KCUDA(call) ::kestrel::cuda::cuda_check((call), #call, __FILE__, __LINE__)
// Checks the last launch error (cheap; no synchronisation).
#define KCUDA_LAUNCH(name) ::kestrel::cuda::cuda_check(cudaGetLastError(), name, __FILE__, __LINE__)

int num_sms();  // multiprocessors of the current device (cached)

// Programmatic dependent launch between consecutive kernels (default on, KESTREL_PDL=0 turns it
// off). It measured 3-10 % slower until bench/NOTES.md v13 moved each kernel's trigger after its
// main loop and pinned the blocks per SM of the per-SM-sized grids (below): then q4 decodes at
// 613.8 against 574.6 tok/s without PDL (ctx 0, H200, 821cf56). Read when kernels are launched or
// captured.
bool pdl_enabled();
void set_pdl_enabled(bool on);
// Blocks-per-SM pinning (KESTREL_PDL_PIN, default 1; bench/NOTES.md v13): launches whose grids are
// sized to a number of blocks per SM (the streamed GEMV at 1 per SM, 2 for lm_head; the
// tensor-core expert kernels, gate/up at 2 and down at 1) take enough dynamic shared memory that
// no more than that many fit on an SM, so that under PDL, launched into a GPU the previous kernel
// still occupies, the block scheduler cannot stack them unevenly. (Pinning route 1's one-row GEMV
// and the GDN step as well measured as noise, 611.6 against 611.3 tok/s, and was dropped.)
bool pdl_pin_enabled();
void set_pdl_pin(bool on);
// The dynamic shared memory a launch of `func` (using `dyn` bytes) takes so that at most
// `per_sm` blocks fit on an SM when pinning is on, else `dyn` itself. Raises the kernel's dynamic
// shared-memory limit as needed.
size_t pinned_smem(const void* func, size_t dyn, int per_sm);
// The GDN decode step triggers its successor right after issuing its state loads instead of
// after its main loop (KESTREL_GDN_EARLY, default 1; 0 for the late trigger): its 128 blocks are
// all resident at once, so the out_proj launch after it prefetches its weights during the step.
// Measured on the H200 at 798dac4: q4 616.2 / 588.9 tok/s (ctx 0 / 4K) against 609.4 / 584.5.
bool gdn_early_trigger();
void set_gdn_early_trigger(bool on);

// GEMV route for M = 1 with one weight format per launch: 1 = one row per warp (measured default),
// 2 = several rows per warp with the first weight loads issued before the activation staging
// (KESTREL_GEMV=2 selects it), 3 = the dot products on the tensor cores for launches whose
// segments are all q4 (gemv.cu; the others take route 1) (KESTREL_GEMV=3). Route 1 also takes
// route 5's streamed kernel (or, where not 16-byte aligned, the tensor-core kernel) for the all-q4
// launches where it measured faster: >= 65536 rows (lm_head), and K = 2048 with >= 8192 rows (GDN
// in_proj, attention q+gate|k|v). 5 = the weights of all-q4
// launches streamed into shared memory by bulk copies, dots on the tensor cores (gemv.cu v5; the
// other launches take route 1) (KESTREL_GEMV=5). (4 was a route folded into 1.)
// Read when kernels are launched or captured.
int gemv_version();
void set_gemv_version(int v);
// Blocks per SM of route 5 (1 or 2, KESTREL_GEMV_STREAM_BPS; default 1), capped by what fits.
// (Route 1 picks its own per launch: gemv.cu, stream_blocks_per_sm.)
int gemv_stream_blocks_per_sm();
void set_gemv_stream_blocks_per_sm(int n);
// Route 1's one-row GEMV (out_proj, o_proj, the router launch) loads each warp's first row, when
// q4, into registers before its wait on the previous kernel (KESTREL_GEMV_PRELOAD=1; off by
// default, which leaves it to the L2 prefetch, until measured: bench/NOTES.md v14). Read when
// kernels are launched or captured.
bool gemv_preload();
void set_gemv_preload(bool on);

// Device weight formats (the subset of kestrel::WFormat the kernels read; kept separate so .cu
// files need no core headers).
enum class DFmt : uint8_t { BF16, Q4, Q8 };
const char* dfmt_name(DFmt f);

// A weight matrix in device memory: [rows, cols], row-major, y = x W^T. Formats: BF16, or affine
// Q4/Q8 in the MLX layout of src/quant/quant.h (codes u32 [rows, cols*bits/32], bf16 scales and
// biases [rows, cols/64]). Stacked experts are one DMat of E*rows rows.
struct DMat {
  DFmt fmt = DFmt::BF16;
  int64_t rows = 0, cols = 0;
  const void* data = nullptr;
  const uint16_t* scales = nullptr;
  const uint16_t* biases = nullptr;
  int group = 64;
  bool valid() const { return data != nullptr; }
  size_t row_bytes() const;  // bytes of codes/elements per row
  size_t nbytes() const;     // data + scales + biases
  // Codes, scales and biases 8-byte aligned: the tensor-core q4 kernels' 8-byte loads
  // (mma_dot.cuh) need it.
  bool aligned8() const {
    return (reinterpret_cast<uintptr_t>(data) | reinterpret_cast<uintptr_t>(scales) |
            reinterpret_cast<uintptr_t>(biases)) % 8 == 0;
  }
  // The same at 16 bytes: the bulk copies of the streamed GEMV (route 5) need it.
  bool aligned16() const {
    return (reinterpret_cast<uintptr_t>(data) | reinterpret_cast<uintptr_t>(scales) |
            reinterpret_cast<uintptr_t>(biases)) % 16 == 0;
  }
};

constexpr int kMaxGemvRows = 8;   // activation rows (M) a GEMV takes at once
constexpr int kMaxGemvSegs = 4;   // matrices fused into one GEMV launch

enum class Prologue : uint8_t {
  None,          // x used as is
  RmsNorm,       // x <- x * rsqrt(mean(x^2) + eps) * norm_w over K
  GatedRmsNorm,  // per group of norm_group: x <- (norm_w * rmsnorm(x)) * silu(z)
};
enum class Epilogue : uint8_t {
  Store,     // y[m, r] = acc
  Residual,  // y[m, r] += acc
  ConvSilu,  // causal conv (kernel 4) over the M rows as consecutive tokens, then SiLU;
             // conv_state fp32 [rows, 3] (oldest first) is updated, y[m, r] = silu(conv)
  Logits,    // y[m, r] = acc, and argmax[m] = max over rows of pack(acc, r) (atomicMax)
};

struct GemvSeg {
  DMat w;
  Epilogue epi = Epilogue::Store;
  float* y = nullptr;  // fp32 [M, ldy]
  int64_t ldy = 0;
  float* conv_state = nullptr;     // ConvSilu: fp32 [w.rows, 3]
  const float* conv_w = nullptr;   // ConvSilu: fp32 [w.rows, 4], tap 3 = current token
  unsigned long long* argmax = nullptr;  // Logits: [M] packed (value, index); may be null
  int64_t argmax_rows = 0;  // Logits: rows >= this are left out of the argmax (0 = all rows)
};

// How one token's MoE routing (softmax + top-k + renormalise over the E router logits) is
// computed: by one warp (k rounds of a warp max) or by a block of 256 threads (one expert per
// thread, ranks by counting). Same selection (ties to the lower expert, NaN last); the weights
// differ only by the softmax sum's order.
enum class RouteAlgo : int { Warp = 0, Block = 1 };
// Where the decode step routes: in the last block of the router GEMV (Tail), as a launch of its
// own after it (Kernel), or in every block of moe_gate_up, which needs the selection first
// (GateUp: no extra launch and no serial tail; block 0 writes the selection for moe_down). Auto
// (the default) resolves per model in resolve_route_place.
enum class RoutePlace : int { Tail = 0, Kernel = 1, GateUp = 2, Auto = 3 };
// KESTREL_MOE_ROUTING=0|1|2|3 (place) and KESTREL_MOE_ROUTE_ALGO=0|1; read when the step is
// recorded. Defaults: Auto + Block. Block measured fastest with every place (d4a7e1e, bench/NOTES.md
// v9). Places measured on the H200 at 1e54141 (bench/NOTES.md v12): with the q4 experts on the
// tensor cores GateUp beats Kernel (q4 ctx 0 535.1 against 524.2 tok/s, 4K 518.9 against 509.3),
// with the scalar bf16 experts Kernel beats GateUp (370.5 against 363.9).
RoutePlace moe_route_place();
void set_moe_route_place(RoutePlace p);
// The place a step records with for experts of format `experts` under the current switches: `p`
// unless it is Auto; Auto is GateUp when moe_gate_up takes the tensor-core kernel (q4 experts,
// moe_mma_enabled, not the fused launch), else Kernel.
RoutePlace resolve_route_place(RoutePlace p, DFmt experts);
RouteAlgo moe_route_algo();
void set_moe_route_algo(RouteAlgo a);
const char* route_place_name(RoutePlace p);
const char* route_algo_name(RouteAlgo a);

// MoE routing fused into the end of the GEMV that computes the router logits: the last block of
// the launch to finish runs the routing over logits[0..E) and writes idx/w (selected experts in
// ascending order, as the CPU oracle accumulates them).
// counter: a device word that is zero before the launch; the last block resets it.
struct RouteTail {
  const float* logits = nullptr;  // null: no routing
  int E = 0, topk = 0;
  int* idx = nullptr;             // [topk]
  float* w = nullptr;             // [topk]
  unsigned* counter = nullptr;
  RouteAlgo algo = RouteAlgo::Block;
};

// The same routing as a launch of its own after a router GEMV without RouteTail (RoutePlace::Kernel).
struct DecodeRouteArgs {
  const float* logits = nullptr;  // [E], written by an earlier launch
  int E = 0, topk = 0;
  int* idx = nullptr;             // [topk], ascending experts
  float* w = nullptr;             // [topk]
  RouteAlgo algo = RouteAlgo::Block;
};
void decode_route(const DecodeRouteArgs& a, cudaStream_t s);

struct GemvArgs {
  int M = 1;
  int64_t K = 0;
  const float* x = nullptr;  // fp32 [M, ldx]
  int64_t ldx = 0;
  Prologue pro = Prologue::None;
  const float* norm_w = nullptr;  // RmsNorm: [K]; GatedRmsNorm: [norm_group]
  float eps = 1e-6f;
  const float* z = nullptr;       // GatedRmsNorm gate: fp32 [M, ldz]
  int64_t ldz = 0;
  int norm_group = 0;
  float* x_out = nullptr;         // optional: the prologue's result, fp32 [M, K]
  GemvSeg seg[kMaxGemvSegs];
  int nseg = 0;
  RouteTail route;
};
void gemv(const GemvArgs& a, cudaStream_t s);
// One-time kernel attributes (large dynamic shared memory); call before any graph capture.
void kernels_init();

// Packs (value, row) so that an unsigned max picks the largest value, then the lowest row.
unsigned long long pack_argmax_host(float v, uint32_t row);
int32_t unpack_argmax_host(unsigned long long key);

// Gated DeltaNet decode for T <= 8 consecutive tokens of one sequence (real widths: Hk 16,
// Hv 32, dk = dv = 128). u: post-conv fp32 [T, ldu] holding q (Hk*dk) | k (Hk*dk) | v (Hv*dv);
// b, a: fp32 [T, ldba] raw projections; state fp32 [Hv, dv, dk] (transposed w.r.t. the CPU's
// [Hv, dk, dv]), updated; o: fp32 [T, Hv*dv] delta-rule output (before the gated norm).
struct GdnDecodeArgs {
  int T = 1;
  const float* u = nullptr;
  int64_t ldu = 0;
  const float* b = nullptr;
  const float* a = nullptr;
  int64_t ldb = 0, lda = 0;
  const float* A_log = nullptr;    // [Hv]
  const float* dt_bias = nullptr;  // [Hv]
  float* state = nullptr;
  float* o = nullptr;
  int Hk = 0, Hv = 0, dk = 0, dv = 0;
};
void gdn_decode(const GdnDecodeArgs& a, cudaStream_t s);

// Gated attention decode of one token (real widths: 16 heads, 2 kv heads, head dim 256,
// rotary 64). qg: fp32 [heads, 2*D] raw q_proj output (query then gate per head); k, v: fp32
// [kv_heads, D] raw projections. q/k RMSNorm and RoPE at position *pos are applied here; the new
// k (normed, roped) and v are written to the bf16 caches [capacity, kv_heads, D] at *pos, then
// the token attends to positions 0..*pos, split over nsplit blocks per kv head (flash decoding),
// and out = attention * sigmoid(gate), fp32 [heads, D].
struct AttnDecodeArgs {
  const float* qg = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* q_norm = nullptr;  // [D], effective multiplier
  const float* k_norm = nullptr;  // [D]
  float eps = 1e-6f;
  const int* pos = nullptr;       // device: position of the new token
  int64_t capacity = 0;
  uint16_t* kcache = nullptr;     // bf16 [capacity, kv_heads, D]
  uint16_t* vcache = nullptr;
  double rope_theta = 1e7;
  int heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
  int nsplit = 1;                 // see attn_nsplit()
  float* partial = nullptr;       // fp32 [heads, nsplit, D + 2] scratch
  float* out = nullptr;
};
constexpr int kAttnMaxSplits = 512;
constexpr int kAttnTile = 32;           // positions per shared-memory tile
constexpr int kAttnMinChunk = 64;       // positions per split block at least (grid sizing)
int attn_nsplit(int64_t capacity);      // splits per kv head for a cache of this capacity
void attn_decode(const AttnDecodeArgs& a, cudaStream_t s);

// MoE decode of one token. The routing (topk_idx ascending, topk_w) comes from the router
// GEMV's RouteTail; h: fp32 [hidden] normed input. moe_gate_up: per selected expert
// act[k, I] = silu(gate_e h) * (up_e h). gate/up: stacked [E*I, hidden].
struct MoeGateUpArgs {
  int topk = 0;
  int64_t E = 0;                 // experts in the stacked gate/up (bounds of topk_idx)
  const float* h = nullptr;
  int64_t hidden = 0, I = 0;
  DMat gate, up;
  const int* topk_idx = nullptr;  // [topk]
  float* act = nullptr;           // fp32 [topk, I]
  // RoutePlace::GateUp: non-null logits [E] make every block route for itself (topk_idx unread);
  // block 0 writes the selection to route_idx / route_w for moe_down.
  const float* logits = nullptr;
  RouteAlgo algo = RouteAlgo::Warp;
  int* route_idx = nullptr;       // [topk]
  float* route_w = nullptr;       // [topk]
  // With logits: non-null makes block 0 set sel_ready[0] = 1 (release) once route_idx / route_w
  // are in memory, for a moe_down with SelRead::Flag on the same two words.
  unsigned* sel_ready = nullptr;
  // Trigger the next launch right after the routing instead of after the main loop (the
  // moe_down_mma blocks then take each SM as a gate/up block leaves it; see moe_down_early).
  bool trigger_early = false;
};
void moe_gate_up(const MoeGateUpArgs& a, cudaStream_t s);
// When moe_down may read the routing selection (topk_idx, topk_w), relative to its wait on the
// previous kernel. Early reads let its expert rows' loads go out before the wait (bench/NOTES.md
// v14). Only the tensor-core kernel (moe_down_takes_mma) reads early; the launcher refuses the
// others.
enum class SelRead : uint8_t {
  AfterWait,  // the previous launch may write the selection (the default)
  Early,      // written two or more launches back (the routing kernel, the router GEMV's tail)
  Flag,       // written by the previous launch's block 0 (moe_gate_up with sel_ready), which sets
              // sel_ready[0]; the down blocks wait for it, the last one resets both words
};
// moe_down: x[r] += sum_k w_k (down_{e_k} act_k)[r] + sigmoid(*sgate) (shared_down sact)[r],
// sact = silu(sg) * su. down: stacked [E*hidden, I]; shared_down [hidden, Is].
struct MoeDownArgs {
  int topk = 0;
  int64_t hidden = 0, I = 0, Is = 0;
  const int* topk_idx = nullptr;
  const float* topk_w = nullptr;
  const float* act = nullptr;     // [topk, I]
  const float* sg = nullptr;      // [Is] shared gate projection
  const float* su = nullptr;      // [Is] shared up projection
  const float* sgate = nullptr;   // [1] shared_expert_gate logit
  DMat down, shared_down;
  float* x = nullptr;             // fp32 [hidden], residual stream, updated
  SelRead sel = SelRead::AfterWait;
  unsigned* sel_ready = nullptr;  // SelRead::Flag: 2 device words, zero before the launch and after it
};
void moe_down(const MoeDownArgs& a, cudaStream_t s);
// Whether moe_down takes the tensor-core kernel for these arguments under the current switches
// (q4, moe_mma_enabled, top-k <= 8).
bool moe_down_takes_mma(const MoeDownArgs& a);
// The decode step's use of the early selection read (KESTREL_MOE_DOWN_EARLY, read when the step is
// recorded): 0 = off (SelRead::AfterWait, the kernel before v14), 1 = moe_down_mma loads its
// expert rows and the shared expert's before its wait (SelRead::Flag with the routing in gate/up,
// Early with it before), 2 (the default: +0.6 % at ctx 0, +1.1 % at 4K on H100, bench/NOTES.md
// v14) = 1 and moe_gate_up triggers right after its routing.
int moe_down_early();
void set_moe_down_early(int level);
// Tiles whose weight loads a block of the tensor-core gate/up keeps in flight (1 or 2,
// KESTREL_MOE_GU_DEPTH; 1, the measured kernel, by default until 2 is measured: bench/NOTES.md v14).
// Read when kernels are launched or captured.
int moe_gate_up_depth();
void set_moe_gate_up_depth(int d);
// moe_gate_up then moe_down as one launch (same arguments; gu.act == dn.act, one weight format
// for gate, up and down): the down blocks wait on counters[0] (a count of finished gate/up
// blocks) instead of a kernel boundary. counters: 2 device words, zero before the first launch
// and left at zero by every launch. Needs more blocks resident than down blocks (checked).
constexpr int kMoeFusedDownRows = 16;  // output rows per down block of the fused launch
struct MoeExpertsArgs {
  MoeGateUpArgs gu;
  MoeDownArgs dn;
  unsigned* counters = nullptr;
};
void moe_experts(const MoeExpertsArgs& a, cudaStream_t s);
// Route of the decode step's MoE experts: the two launches (default) or fused (moe_experts,
// KESTREL_MOE_FUSED=1; measured slower on the H200 at 5740032: 42 us per layer in Nsight Compute
// against 22 us for the two launches, q4 ctx 0 342.6 vs 430.9 tok/s). Read when the step is
// recorded.
bool moe_fused_enabled();
void set_moe_fused_enabled(bool on);
// The q4 MoE experts on the tensor cores (moe_gate_up_mma_kernel, and moe_down_mma_kernel for
// top-k <= 8; larger top-k keeps the scalar moe_down), the dot core of GEMV route 3:
// the default (KESTREL_MOE_MMA=0 for the scalar moe_gate_up/moe_down: on the H200 at 4aabe9a, q4
// ctx 0 522.1 vs 468.9 tok/s; moe_probe 13.2 vs 18.4 us per layer for the two launches). Read when
// kernels are launched or captured. The fused launch (moe_experts) does not use it.
bool moe_mma_enabled();
void set_moe_mma_enabled(bool on);

// Start of a decode step (one block): takes the token (from *argmax when non-null, else from
// *token), writes it to *token and history[*len], sets *pos = *len, ++*len, resets *argmax to 0,
// and writes the embedding row to x fp32 [hidden].
struct StepBeginArgs {
  unsigned long long* argmax = nullptr;
  int32_t* token = nullptr;
  int* pos = nullptr;
  int* len = nullptr;
  int32_t* history = nullptr;    // [capacity]
  DMat embed;
  float* x = nullptr;
};
void step_begin(const StepBeginArgs& a, cudaStream_t s);

// Fills n elements with deterministic pseudo-random values (synthetic weights, tests):
// uniform in [lo, hi) from (seed, index); bf16 output for fill_bf16, u32 words for fill_u32.
void fill_uniform_f32(float* p, size_t n, uint64_t seed, float lo, float hi, cudaStream_t s);
void fill_uniform_bf16(uint16_t* p, size_t n, uint64_t seed, float lo, float hi, cudaStream_t s);
void fill_random_u32(uint32_t* p, size_t n, uint64_t seed, cudaStream_t s);
void fill_f32(float* p, size_t n, float v, cudaStream_t s);

}  // namespace kestrel::cuda
