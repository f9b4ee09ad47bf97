// Validated launchers of the CUDA kernel families (kernels.h): every precondition is checked here,
// in plain C++, before the raw launch functions of launch.h run the kernels.
#include "core/check.h"
#include "cuda/launch.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>
#include <cstdlib>
#include <initializer_list>
#include <string>

namespace kestrel::cuda {

void cuda_check(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it, so the next check does not report this failure again
    throw Error(fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(e),
                            cudaGetErrorString(e), what, file, line));
  }
}

namespace {
// A route switch: environment variable `name` when it spells one of `allowed`, else `dflt`.
int env_choice(const char* name, std::initializer_list<int> allowed, int dflt) {
  const char* e = std::getenv(name);
  if (e == nullptr) return dflt;
  for (int v : allowed)
    if (std::to_string(v) == e) return v;
  return dflt;
}
int& pdl_pin_flag() {
  static int f = env_choice("KESTREL_PDL_PIN", {0, 1}, 1);
  return f;
}
int& gdn_early_flag() {
  static int f = env_choice("KESTREL_GDN_EARLY", {0, 1}, 1);
  return f;
}
int& pdl_flag() {
  static int f = env_choice("KESTREL_PDL", {0, 1}, 1);
  return f;
}
int& gemv_flag() {
  static int f = env_choice("KESTREL_GEMV", {1, 2, 3, 5}, 1);
  return f;
}
int& gemv_stream_bps_flag() {
  static int f = env_choice("KESTREL_GEMV_STREAM_BPS", {1, 2}, 1);
  return f;
}
int& gemv_preload_flag() {
  static int f = env_choice("KESTREL_GEMV_PRELOAD", {0, 1}, 0);
  return f;
}
int& moe_fused_flag() {
  static int f = env_choice("KESTREL_MOE_FUSED", {0, 1}, 0);
  return f;
}
int& moe_mma_flag() {
  static int f = env_choice("KESTREL_MOE_MMA", {0, 1}, 1);
  return f;
}
int& moe_down_early_flag() {
  static int f = env_choice("KESTREL_MOE_DOWN_EARLY", {0, 1, 2}, 2);
  return f;
}
int& moe_gu_depth_flag() {
  static int f = env_choice("KESTREL_MOE_GU_DEPTH", {1, 2}, 1);
  return f;
}
int& moe_route_place_flag() {
  static int f = env_choice("KESTREL_MOE_ROUTING", {0, 1, 2, 3}, 3);
  return f;
}
int& moe_route_algo_flag() {
  static int f = env_choice("KESTREL_MOE_ROUTE_ALGO", {0, 1}, 1);
  return f;
}
// The sizes the routing (moe_route.cuh, both algorithms) handles, wherever it runs.
void check_routing(int E, int topk, const char* who) {
  KESTREL_CHECK(E >= 1 && E <= 512 && topk >= 1 && topk <= 16 && topk <= E,
                "{}: E {} top-k {} (supported E <= 512, k <= 16)", who, E, topk);
}
}  // namespace
bool pdl_enabled() { return pdl_flag() != 0; }
bool pdl_pin_enabled() { return pdl_pin_flag() != 0; }
void set_pdl_pin(bool on) { pdl_pin_flag() = on ? 1 : 0; }
bool gdn_early_trigger() { return gdn_early_flag() != 0; }
void set_gdn_early_trigger(bool on) { gdn_early_flag() = on ? 1 : 0; }
size_t pinned_smem(const void* func, size_t dyn, int per_sm) {
  if (!pdl_pin_enabled()) return dyn;
  KESTREL_CHECK(per_sm >= 1, "pinned_smem: {} blocks per SM", per_sm);
  static const std::pair<int, int> sm = [] {
    int dev = 0, cap = 0, reserved = 0;
    KCUDA(cudaGetDevice(&dev));
    KCUDA(cudaDeviceGetAttribute(&cap, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    KCUDA(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
    return std::pair<int, int>{cap, reserved};
  }();
  cudaFuncAttributes fa{};
  KCUDA(cudaFuncGetAttributes(&fa, func));
  // per_sm + 1 blocks of `total` (+ the per-block reservation) must not fit; per_sm must.
  const size_t total = size_t(sm.first / (per_sm + 1) - sm.second + 128);
  KESTREL_CHECK(total + size_t(sm.second) <= size_t(sm.first / per_sm), "pinned_smem: {} blocks per SM", per_sm);
  const size_t want = total > fa.sharedSizeBytes ? total - fa.sharedSizeBytes : 0;
  const size_t d = std::max(dyn, want);
  if (d > size_t(fa.maxDynamicSharedSizeBytes))
    KCUDA(cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, int(d)));
  return d;
}
void set_pdl_enabled(bool on) { pdl_flag() = on ? 1 : 0; }
int gemv_version() { return gemv_flag(); }
void set_gemv_version(int v) {
  KESTREL_CHECK((v >= 1 && v <= 3) || v == 5, "GEMV version {} (1, 2, 3 or 5)", v);
  gemv_flag() = v;
}
int gemv_stream_blocks_per_sm() { return gemv_stream_bps_flag(); }
bool gemv_preload() { return gemv_preload_flag() != 0; }
void set_gemv_preload(bool on) { gemv_preload_flag() = on ? 1 : 0; }
void set_gemv_stream_blocks_per_sm(int n) {
  KESTREL_CHECK(n == 1 || n == 2, "route-5 GEMV blocks per SM {} (1 or 2)", n);
  gemv_stream_bps_flag() = n;
}

int num_sms() {
  static int n = [] {
    int dev = 0, v = 0;
    KCUDA(cudaGetDevice(&dev));
    KCUDA(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

const char* dfmt_name(DFmt f) {
  switch (f) {
    case DFmt::BF16: return "BF16";
    case DFmt::Q4: return "Q4";
    case DFmt::Q8: return "Q8";
  }
  return "?";
}

size_t DMat::row_bytes() const {
  switch (fmt) {
    case DFmt::BF16: return size_t(cols) * 2;
    case DFmt::Q4: return size_t(cols) / 2;
    case DFmt::Q8: return size_t(cols);
  }
  return 0;
}
size_t DMat::nbytes() const {
  size_t n = row_bytes() * size_t(rows);
  if (fmt == DFmt::Q4 || fmt == DFmt::Q8) n += 2 * 2 * size_t(rows) * size_t(cols / group);
  return n;
}


void kernels_init() {
  (void)num_sms();
  gemv_init();
  for (DFmt f : {DFmt::BF16, DFmt::Q4, DFmt::Q8}) (void)moe_experts_resident(f);  // outside any capture
}

void gemv(const GemvArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.M >= 1 && a.M <= kMaxGemvRows, "gemv: M = {} outside 1..{}", a.M, kMaxGemvRows);
  KESTREL_CHECK(a.nseg >= 1 && a.nseg <= kMaxGemvSegs, "gemv: {} segments", a.nseg);
  KESTREL_CHECK(a.K == 512 || a.K == 2048 || a.K == 4096,
                "gemv: K = {} (kernels exist for 512, 2048, 4096)", a.K);
  KESTREL_CHECK(a.x != nullptr && a.ldx >= a.K, "gemv: x null or ldx {} < K {}", a.ldx, a.K);
  // Activations are staged with float4 loads.
  KESTREL_CHECK(reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && a.ldx % 4 == 0,
                "gemv: x must be 16-byte aligned with ldx % 4 == 0 (ldx {})", a.ldx);
  if (a.pro != Prologue::None)
    KESTREL_CHECK(reinterpret_cast<uintptr_t>(a.norm_w) % 16 == 0, "gemv: norm weight not 16-byte aligned");
  if (a.x_out != nullptr)
    KESTREL_CHECK(reinterpret_cast<uintptr_t>(a.x_out) % 16 == 0, "gemv: x_out not 16-byte aligned");
  if (a.pro == Prologue::RmsNorm) KESTREL_CHECK(a.norm_w != nullptr, "gemv: RmsNorm without weight");
  if (a.pro == Prologue::GatedRmsNorm)
    KESTREL_CHECK(a.norm_group == 128 && a.K % 128 == 0 && a.z != nullptr && a.norm_w != nullptr &&
                      a.ldz >= a.K,
                  "gemv: GatedRmsNorm needs group 128, z and a weight (group {})", a.norm_group);
  if (a.pro == Prologue::GatedRmsNorm)
    KESTREL_CHECK(reinterpret_cast<uintptr_t>(a.z) % 16 == 0 && a.ldz % 4 == 0,
                  "gemv: z must be 16-byte aligned with ldz % 4 == 0");
  int64_t total = 0;
  for (int i = 0; i < a.nseg; ++i) {
    const GemvSeg& g = a.seg[i];
    KESTREL_CHECK(g.w.valid() && g.w.cols == a.K && g.w.rows > 0,
                  "gemv: segment {} is [{}, {}], expected [*, {}]", i, g.w.rows, g.w.cols, a.K);
    KESTREL_CHECK(g.w.fmt == DFmt::BF16 || g.w.fmt == DFmt::Q4 || g.w.fmt == DFmt::Q8,
                  "gemv: segment {} format {} (BF16, Q4, Q8 supported)", i, dfmt_name(g.w.fmt));
    if (g.w.fmt != DFmt::BF16)
      KESTREL_CHECK(g.w.group == 64 && g.w.scales && g.w.biases, "gemv: affine group {} (64 needed)",
                    g.w.group);
    const int epc = g.w.fmt == DFmt::BF16 ? 8 : g.w.fmt == DFmt::Q8 ? 16 : 32;
    KESTREL_CHECK((a.K / epc) % 32 == 0, "gemv: K {} too narrow for format {}", a.K,
                  dfmt_name(g.w.fmt));
    KESTREL_CHECK(reinterpret_cast<uintptr_t>(g.w.data) % 16 == 0, "gemv: weights not 16-byte aligned");
    KESTREL_CHECK(g.y != nullptr && g.ldy >= g.w.rows, "gemv: segment {} output null or ldy {} < {}", i,
                  g.ldy, g.w.rows);
    if (g.epi == Epilogue::ConvSilu)
      KESTREL_CHECK(g.conv_state && g.conv_w, "gemv: ConvSilu without state/weights");
    total += g.w.rows;
  }
  if (a.route.logits != nullptr) {
    const RouteTail& r = a.route;
    check_routing(r.E, r.topk, "gemv route");
    KESTREL_CHECK(r.idx && r.w && r.counter, "gemv route: null output or counter");
    KESTREL_CHECK(int(r.algo) == 0 || int(r.algo) == 1, "gemv route: routing algorithm {}", int(r.algo));
    bool produced = false;  // the logits must be one of this launch's outputs
    for (int i = 0; i < a.nseg; ++i)
      produced |= a.seg[i].y == r.logits && a.seg[i].w.rows >= r.E && a.seg[i].epi == Epilogue::Store;
    KESTREL_CHECK(produced, "gemv route: logits are not a Store segment of this launch with >= E rows");
  }
  gemv_init();
  gemv_launch(a, total, s);
}


void gdn_decode(const GdnDecodeArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.dk == 128 && a.dv == 128, "gdn_decode: head dims {}x{} (kernel is for 128x128)",
                a.dk, a.dv);
  KESTREL_CHECK(a.Hk > 0 && a.Hv % a.Hk == 0, "gdn_decode: Hv {} not a multiple of Hk {}", a.Hv, a.Hk);
  KESTREL_CHECK(a.T >= 1 && a.T <= 8, "gdn_decode: T = {} outside 1..{}", a.T, 8);
  KESTREL_CHECK(a.u && a.b && a.a && a.A_log && a.dt_bias && a.state && a.o, "gdn_decode: null pointer");
  KESTREL_CHECK(a.ldu >= 2 * a.Hk * a.dk + a.Hv * a.dv && a.ldu % 4 == 0, "gdn_decode: ldu {}", a.ldu);
  KESTREL_CHECK(a.dv % 32 == 0, "gdn_decode: dv {}", a.dv);
  gdn_decode_launch(a, s);
}


void attn_decode(const AttnDecodeArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.head_dim == 256 && a.kv_heads > 0 && a.heads == a.kv_heads * 8 &&
                    a.rotary_dim == 64,
                "attn_decode: heads {}/{} x {} rot {} (kernel is for 8 q heads per kv head, dim 256, "
                "rotary 64)",
                a.heads, a.kv_heads, a.head_dim, a.rotary_dim);
  KESTREL_CHECK(a.nsplit >= 1 && a.nsplit <= kAttnMaxSplits, "attn_decode: nsplit {}", a.nsplit);
  KESTREL_CHECK(a.qg && a.k && a.v && a.q_norm && a.k_norm && a.pos && a.kcache && a.vcache &&
                    a.partial && a.out,
                "attn_decode: null pointer");
  attn_decode_launch(a, s);
}


namespace {
void check_gate_up(const MoeGateUpArgs& a) {
  KESTREL_CHECK(a.E >= 1 && a.E <= 512 && a.topk >= 1 && a.topk <= 16 && a.topk <= a.E,
                "moe_gate_up: E {} top-k {} (supported E <= {}, k <= {})", a.E, a.topk, 512, 16);
  KESTREL_CHECK(a.hidden == 2048, "moe_gate_up: hidden {} (kernel is for 2048)", a.hidden);
  KESTREL_CHECK(a.gate.valid() && a.up.valid() && a.gate.fmt == a.up.fmt &&
                    a.gate.rows == int64_t(a.E) * a.I && a.up.rows == a.gate.rows &&
                    a.gate.cols == a.hidden && a.up.cols == a.hidden,
                "moe_gate_up: stacked gate/up must be [E*I, hidden] of one format");
  KESTREL_CHECK(a.h && a.act && (a.logits ? a.route_idx && a.route_w : a.topk_idx != nullptr),
                "moe_gate_up: null pointer");
  KESTREL_CHECK(int(a.algo) == 0 || int(a.algo) == 1, "moe_gate_up: routing algorithm {}", int(a.algo));
  KESTREL_CHECK(reinterpret_cast<uintptr_t>(a.h) % 16 == 0, "moe_gate_up: h not 16-byte aligned");
  KESTREL_CHECK(a.sel_ready == nullptr || a.logits != nullptr,
                "moe_gate_up: sel_ready is set by the routing in gate/up (logits null)");
  if (a.gate.fmt == DFmt::Q4 && moe_mma_enabled())  // moe_gate_up_mma_kernel: 8-unit tiles, 8-byte loads
    KESTREL_CHECK(a.I % 8 == 0 && a.gate.aligned8() && a.up.aligned8(),
                  "moe_gate_up (tensor cores): I {} must be a multiple of 8 and the weights 8-byte aligned", a.I);
}
void check_down(const MoeDownArgs& a) {
  KESTREL_CHECK(a.topk >= 1 && a.topk <= 16, "moe_down: top-k {}", a.topk);
  KESTREL_CHECK(int(a.sel) <= 2, "moe_down: selection read {}", int(a.sel));
  KESTREL_CHECK(a.sel == SelRead::AfterWait || moe_down_takes_mma(a),
                "moe_down: an early selection read needs the tensor-core kernel (q4, top-k <= 8, mma on)");
  KESTREL_CHECK((a.sel == SelRead::Flag) == (a.sel_ready != nullptr),
                "moe_down: sel_ready goes with SelRead::Flag and only with it");
  KESTREL_CHECK(a.I == 512 && a.Is == 512, "moe_down: expert widths {}/{} (kernel is for 512)", a.I,
                a.Is);
  KESTREL_CHECK(a.hidden % 8 == 0, "moe_down: hidden {} not a multiple of {}", a.hidden,
                8);
  KESTREL_CHECK(a.down.valid() && a.shared_down.valid() && a.down.fmt == a.shared_down.fmt &&
                    a.down.cols == a.I && a.shared_down.cols == a.Is &&
                    a.shared_down.rows == a.hidden && a.down.rows % a.hidden == 0,
                "moe_down: down [E*hidden, I] and shared_down [hidden, Is] of one format needed "
                "({} vs {})",
                dfmt_name(a.down.fmt), dfmt_name(a.shared_down.fmt));
  KESTREL_CHECK(a.topk_idx && a.topk_w && a.act && a.sg && a.su && a.sgate && a.x,
                "moe_down: null pointer");
  KESTREL_CHECK(reinterpret_cast<uintptr_t>(a.act) % 16 == 0 && reinterpret_cast<uintptr_t>(a.sg) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.su) % 16 == 0,
                "moe_down: activations not 16-byte aligned");
  KESTREL_CHECK(a.down.fmt == DFmt::Q4 || a.down.fmt == DFmt::Q8 || a.down.fmt == DFmt::BF16,
                "moe_down: format {}", dfmt_name(a.down.fmt));
  if (moe_down_takes_mma(a))  // moe_down_mma_kernel: 16-row tiles
    KESTREL_CHECK(a.hidden % 16 == 0 && a.down.aligned8() && a.shared_down.aligned8(),
                  "moe_down (tensor cores): hidden {} must be a multiple of 16 and the weights 8-byte aligned",
                  a.hidden);
}
}  // namespace

bool moe_fused_enabled() { return moe_fused_flag() != 0; }
bool moe_mma_enabled() { return moe_mma_flag() != 0; }
bool moe_down_takes_mma(const MoeDownArgs& a) { return a.down.fmt == DFmt::Q4 && moe_mma_enabled() && a.topk <= 8; }
int moe_down_early() { return moe_down_early_flag(); }
int moe_gate_up_depth() { return moe_gu_depth_flag(); }
void set_moe_gate_up_depth(int d) {
  KESTREL_CHECK(d == 1 || d == 2, "gate/up tiles in flight {} (1 or 2)", d);
  moe_gu_depth_flag() = d;
}
void set_moe_down_early(int level) {
  KESTREL_CHECK(level >= 0 && level <= 2, "moe_down early level {} (0, 1 or 2)", level);
  moe_down_early_flag() = level;
}
void set_moe_mma_enabled(bool on) { moe_mma_flag() = on ? 1 : 0; }
void set_moe_fused_enabled(bool on) { moe_fused_flag() = on ? 1 : 0; }
RoutePlace moe_route_place() { return RoutePlace(moe_route_place_flag()); }
void set_moe_route_place(RoutePlace p) {
  KESTREL_CHECK(int(p) >= 0 && int(p) <= 3, "routing place {}", int(p));
  moe_route_place_flag() = int(p);
}
RoutePlace resolve_route_place(RoutePlace p, DFmt experts) {
  if (p != RoutePlace::Auto) return p;
  return experts == DFmt::Q4 && moe_mma_enabled() && !moe_fused_enabled() ? RoutePlace::GateUp : RoutePlace::Kernel;
}
RouteAlgo moe_route_algo() { return RouteAlgo(moe_route_algo_flag()); }
void set_moe_route_algo(RouteAlgo a) {
  KESTREL_CHECK(int(a) == 0 || int(a) == 1, "routing algorithm {}", int(a));
  moe_route_algo_flag() = int(a);
}
const char* route_place_name(RoutePlace p) {
  switch (p) {
    case RoutePlace::Tail: return "tail";
    case RoutePlace::Kernel: return "kernel";
    case RoutePlace::GateUp: return "gate_up";
    case RoutePlace::Auto: return "auto";
  }
  return "?";
}
const char* route_algo_name(RouteAlgo a) { return a == RouteAlgo::Block ? "block" : "warp"; }

void decode_route(const DecodeRouteArgs& a, cudaStream_t s) {
  check_routing(a.E, a.topk, "decode_route");
  KESTREL_CHECK(a.logits && a.idx && a.w, "decode_route: null pointer");
  KESTREL_CHECK(int(a.algo) == 0 || int(a.algo) == 1, "decode_route: routing algorithm {}", int(a.algo));
  decode_route_launch(a, s);
}

void moe_gate_up(const MoeGateUpArgs& a, cudaStream_t s) {
  check_gate_up(a);
  moe_gate_up_launch(a, s);
}

void moe_down(const MoeDownArgs& a, cudaStream_t s) {
  check_down(a);
  moe_down_launch(a, s);
}

void moe_experts(const MoeExpertsArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.gu.logits == nullptr,
                "moe_experts: the fused launch routes before it (tail or kernel), not in its gate/up blocks");
  check_gate_up(a.gu);
  check_down(a.dn);
  KESTREL_CHECK(a.counters != nullptr, "moe_experts: null counters");
  KESTREL_CHECK(a.dn.sel == SelRead::AfterWait && a.gu.sel_ready == nullptr && !a.gu.trigger_early,
                "moe_experts: the fused launch reads the selection after its wait");
  KESTREL_CHECK(a.gu.act == a.dn.act && a.gu.topk == a.dn.topk && a.gu.topk_idx == a.dn.topk_idx &&
                    a.gu.I == a.dn.I && a.gu.hidden == a.dn.hidden,
                "moe_experts: the gate/up and down parts must share act, top-k, routing and widths");
  KESTREL_CHECK(a.gu.gate.fmt == a.dn.down.fmt, "moe_experts: gate/up {} and down {} formats differ",
                dfmt_name(a.gu.gate.fmt), dfmt_name(a.dn.down.fmt));
  // The down blocks wait for the gate/up blocks: the launch is safe only if a gate/up block can
  // be resident while every down block waits.
  const int resident = moe_experts_resident(a.gu.gate.fmt);
  KESTREL_CHECK(a.dn.hidden % kMoeFusedDownRows == 0, "moe_experts: hidden {} not a multiple of {}",
                a.dn.hidden, kMoeFusedDownRows);
  KESTREL_CHECK(resident > a.dn.hidden / kMoeFusedDownRows,
                "moe_experts: {} blocks resident, {} down blocks would wait", resident,
                a.dn.hidden / kMoeFusedDownRows);
  moe_experts_launch(a, s);
}


void step_begin(const StepBeginArgs& a, cudaStream_t s) {
  KESTREL_CHECK(a.token && a.pos && a.len && a.history && a.x && a.embed.valid(),
                "step_begin: null pointer");
  KESTREL_CHECK(a.embed.fmt == DFmt::BF16 || a.embed.fmt == DFmt::Q4 || a.embed.fmt == DFmt::Q8,
                "step_begin: embedding format {}", dfmt_name(a.embed.fmt));
  step_begin_launch(a, s);
}

}  // namespace kestrel::cuda
