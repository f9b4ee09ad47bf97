// Prefill kernels (src/cuda/prefill.h) against the CPU oracle (src/cpu/ops.h) on fresh random
// inputs at the model's real widths and the token counts, outputs poisoned (NaN) first.
// Tolerances (relative L2 against the fp32 oracle): GEMM / MoE with fp32 A on the Split route
// (bf16 hi + lo, exact integer weights) 1e-4; on the F16 route (one fp16 plane, expected ~3e-4)
// 1e-3 for one GEMM and 2e-3 for the MoE block; bf16 A given (A16) and attention 1e-2. The delta
// rule is fp32: 1e-4.
#include "core/config.h"
#include "cpu/ops.h"
#include "cuda/prefill.h"
#include "util.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

namespace kestrel::cuda::test {
namespace {

constexpr float kEps = 1e-6f;
// The Pipe kernel's dequantising route (KESTREL_PIPE_MMA=dq): bf16 A times bf16 weights (Q4:
// bf16(q s + b)), ~2^-9 relative per operand, expected ~2-3e-3 relative L2 on these inputs.
constexpr double kDqBound = 6e-3;

std::vector<float> bf16_round(std::vector<float> v) {
  for (auto& x : v) x = round_bf16(x);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Dense fused-dequant GEMM.
// bf16io: A converted on the GPU to bf16 (prefill_to_bf16) and given as A16; output in bf16 (C16).
// kern = Pipe: A split on the GPU (prefill_pipe_split) and given as PrefillGemmArgs::pipe.
struct PipeBufs {
  std::unique_ptr<DevBuf> hi, lo, sum;
  PipeBufs(int64_t rows, int64_t K)
      : hi(poisoned16(size_t(rows * K))), lo(poisoned16(size_t(rows * K))),
        sum(poisoned(size_t(rows * K / 64))) {}
  PipeA split(const float* A, int64_t rows, int64_t K, int64_t lda) const {
    PipeSplitArgs a;
    a.A = A;
    a.rows = rows;
    a.K = K;
    a.lda = lda;
    a.hi = hi->as<uint16_t>();
    a.lo = lo->as<uint16_t>();
    a.sum = sum->as<float>();
    return prefill_pipe_split(a, nullptr);
  }
};

void run_gemm(WFormat f, int64_t M, int64_t N, int64_t K, GemmEpi epi, uint32_t seed,
              bool bf16io = false, PrefillAPrec aprec = PrefillAPrec::Split,
              PrefillGemmKernel kern = PrefillGemmKernel::Reg) {
  std::mt19937 g(seed);
  auto W = make_mat(f, N, K, g);
  auto W2 = make_mat(f, N, K, g);
  auto x = randv(size_t(M * K), g, -2.f, 2.f);
  std::vector<float> want(size_t(M * N)), up(size_t(M * N));
  cpu::matmul(W->m, x.data(), M, want.data());
  std::vector<float> init;
  if (epi == GemmEpi::SiluMul) {
    cpu::matmul(W2->m, x.data(), M, up.data());
    for (size_t i = 0; i < want.size(); ++i) want[i] = cpu::silu(want[i]) * up[i];
  } else if (epi == GemmEpi::Residual) {
    init = randv(want.size(), g);
    for (size_t i = 0; i < want.size(); ++i) want[i] += init[i];
  }
  auto dW = to_dev(W->m);
  auto dW2 = to_dev(W2->m);
  auto dx = to_dev(x);
  auto dy = epi == GemmEpi::Residual ? to_dev(init) : poisoned(want.size());
  auto dx16 = poisoned16(size_t(M * K));
  auto dy16 = poisoned16(want.size());
  PrefillGemmArgs a;
  a.M = M;
  a.N = N;
  a.K = K;
  const bool pipe = kern == PrefillGemmKernel::Pipe;
  const PipeBufs pb(pipe ? M : 0, K);
  if (bf16io) {
    prefill_to_bf16(dx->as<float>(), M, K, K, dx16->as<uint16_t>(), K, nullptr);
    a.A16 = dx16->as<uint16_t>();
    a.C16 = dy16->as<uint16_t>();
  } else if (pipe) {
    a.pipe = pb.split(dx->as<float>(), M, K, K);
    a.C = dy->as<float>();
  } else {
    a.A = dx->as<float>();
    a.C = dy->as<float>();
  }
  DevBuf flag(16);
  KCUDA(cudaMemset(flag.p, 0, 16));
  a.aprec = aprec;
  a.range_flag = flag.as<unsigned>();
  a.lda = K;
  a.W = dW->d;
  if (epi == GemmEpi::SiluMul) a.W2 = dW2->d;
  a.epi = epi;
  a.ldc = N;
  prefill_gemm(a, nullptr);
  std::vector<float> got;
  if (bf16io) {
    for (uint16_t v : to_host<uint16_t>(*dy16, want.size())) got.push_back(bf16_to_f32(v));
  } else {
    got = to_host<float>(*dy, want.size());
  }
  const bool f16 = aprec == PrefillAPrec::F16 && !bf16io;
  const std::string what = fmt::format("prefill_gemm {} M={} N={} K={} epi={}{}", wformat_name(f), M,
                                       N, K, int(epi), bf16io ? " bf16 in/out" : f16 ? " f16" : pipe ? " pipe" : " split");
  const bool dq = pipe && prefill_pipe_q4_mma() == PipeMma::Dq;
  EXPECT_LT(rel_err(got, want, (what + (dq ? " dq" : "")).c_str()), bf16io ? 1e-2 : f16 ? 1e-3 : dq ? kDqBound : 1e-4)
      << what << (dq ? " dq" : "");
  EXPECT_EQ(to_host<unsigned>(flag, 1)[0], 0u) << what << ": range flag set for |A| <= 2";
}
constexpr PrefillAPrec kRoutes[] = {PrefillAPrec::Split, PrefillAPrec::F16};

TEST(PrefillGemm, DenseMatchesCpuAllFormatsAndTokenCounts) {
  REQUIRE_GPU();
  uint32_t seed = 100;
  for (PrefillAPrec r : kRoutes) {
    for (WFormat f : {WFormat::BF16, WFormat::Q4, WFormat::Q8})
      for (int64_t M : {1, 7, 63, 64, 65, 1000}) run_gemm(f, M, 200, 512, GemmEpi::Store, seed++, false, r);
    // Real widths: K 2048 (hidden) and 4096 (o_proj/out_proj), N not a multiple of the tile; 128-row
    // tiles (enough tiles to fill the machine) for every format on the F16 route.
    run_gemm(WFormat::Q4, 4096, 264, 2048, GemmEpi::Store, seed++, false, r);
    run_gemm(WFormat::Q4, 4096, 4096, 2048, GemmEpi::Store, seed++, false, r);
    run_gemm(WFormat::Q8, 2048, 8192, 512, GemmEpi::Store, seed++, false, r);
    run_gemm(WFormat::BF16, 4096, 130, 4096, GemmEpi::Store, seed++, false, r);
    run_gemm(WFormat::Q8, 300, 256, 2048, GemmEpi::Store, seed++, false, r);
    run_gemm(WFormat::Q4, 65, 1, 2048, GemmEpi::Store, seed++, false, r);  // shared_expert_gate: N = 1
  }
}

// F16 route: an A element beyond the limit (65504, or a lower test limit) sets the range flag.
TEST(PrefillGemm, F16RangeFlag) {
  REQUIRE_GPU();
  std::mt19937 g(170);
  for (WFormat f : {WFormat::BF16, WFormat::Q4}) {
    auto W = make_mat(f, 256, 512, g);
    auto dW = to_dev(W->m);
    for (int c = 0; c < 3; ++c) {
      auto x = randv(size_t(300 * 512), g, -2.f, 2.f);
      float limit = kF16Max;
      if (c == 1) x[size_t(299 * 512 + 511)] = -1e5f;  // the last element of the last row
      if (c == 2) limit = 1.5f;
      auto dx = to_dev(x);
      DevBuf y(300 * 256 * 4), flag(16);
      KCUDA(cudaMemset(flag.p, 0, 16));
      PrefillGemmArgs a;
      a.M = 300;
      a.N = 256;
      a.K = 512;
      a.A = dx->as<float>();
      a.lda = 512;
      a.W = dW->d;
      a.C = y.as<float>();
      a.ldc = 256;
      a.aprec = PrefillAPrec::F16;
      a.range_flag = flag.as<unsigned>();
      a.f16_limit = limit;
      prefill_gemm(a, nullptr);
      EXPECT_EQ(to_host<unsigned>(flag, 1)[0], c == 0 ? 0u : 1u) << wformat_name(f) << " case " << c;
    }
  }
}

TEST(PrefillGemm, Bf16InputAndOutput) {
  REQUIRE_GPU();
  uint32_t seed = 150;
  for (WFormat f : {WFormat::BF16, WFormat::Q4, WFormat::Q8})
    for (int64_t M : {1, 63, 1000}) run_gemm(f, M, 200, 512, GemmEpi::Store, seed++, true);
  run_gemm(WFormat::Q4, 4096, 384, 2048, GemmEpi::Store, seed++, true);
  run_gemm(WFormat::Q4, 1000, 512, 2048, GemmEpi::SiluMul, seed++, true);
  run_gemm(WFormat::BF16, 65, 1, 2048, GemmEpi::Store, seed++, true);
}

TEST(PrefillGemm, ResidualAndSiluMulEpilogues) {
  REQUIRE_GPU();
  uint32_t seed = 200;
  for (PrefillAPrec r : kRoutes)
    for (WFormat f : {WFormat::BF16, WFormat::Q4, WFormat::Q8}) {
      run_gemm(f, 65, 2048, 512, GemmEpi::Residual, seed++, false, r);
      run_gemm(f, 1000, 512, 2048, GemmEpi::SiluMul, seed++, false, r);
      run_gemm(f, 4096, 512, 2048, GemmEpi::SiluMul, seed++, false, r);
      run_gemm(f, 7, 100, 2048, GemmEpi::SiluMul, seed++, false, r);
    }
}

TEST(PrefillGemm, RejectsBadShapes) {
  REQUIRE_GPU();
  std::mt19937 g(3);
  auto W = make_mat(WFormat::Q4, 64, 512, g);
  auto dW = to_dev(W->m);
  DevBuf x(64 * 512 * 4), y(64 * 64 * 4);
  PrefillGemmArgs a;
  a.M = 64;
  a.N = 64;
  a.K = 500;  // not a multiple of 64
  a.A = x.as<float>();
  a.lda = 512;
  a.W = dW->d;
  a.C = y.as<float>();
  a.ldc = 64;
  EXPECT_THROW(prefill_gemm(a, nullptr), Error);
  a.K = 512;
  a.N = 65;  // more rows than W has
  EXPECT_THROW(prefill_gemm(a, nullptr), Error);
  a.N = 64;
  a.epi = GemmEpi::SiluMul;  // no up matrix
  EXPECT_THROW(prefill_gemm(a, nullptr), Error);
}

// ---------------------------------------------------------------------------------------------
// Routing: softmax, top-k, renormalise, sorted slots.
struct HostRoute {
  std::vector<int> idx;    // [T*k], ascending expert order per token
  std::vector<float> w;
};
HostRoute host_route(const std::vector<float>& logits, int64_t T, int E, int k) {
  HostRoute r;
  std::vector<float> p(static_cast<size_t>(E));
  std::vector<int> id(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* lt = logits.data() + t * E;
    const float mx = *std::max_element(lt, lt + E);
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += (p[size_t(e)] = std::exp(lt[e] - mx));
    for (auto& x : p) x = float(x / sum);
    std::iota(id.begin(), id.end(), 0);
    std::partial_sort(id.begin(), id.begin() + k, id.end(), [&](int a, int b) {
      return p[size_t(a)] != p[size_t(b)] ? p[size_t(a)] > p[size_t(b)] : a < b;
    });
    float top = 0;
    for (int i = 0; i < k; ++i) top += p[size_t(id[size_t(i)])];
    std::vector<std::pair<int, float>> sel;
    for (int i = 0; i < k; ++i) sel.push_back({id[size_t(i)], p[size_t(id[size_t(i)])] / top});
    std::sort(sel.begin(), sel.end());
    for (auto& s : sel) {
      r.idx.push_back(s.first);
      r.w.push_back(s.second);
    }
  }
  return r;
}

struct DevRoute {
  std::unique_ptr<DevBuf> idx, w, counts, goff, toff, tailoff, sorted;
  MoeRouteArgs a;
  DevRoute(int64_t T, int E, int k) {
    idx = std::make_unique<DevBuf>(size_t(T * k) * 4);
    w = poisoned(size_t(T * k));
    counts = std::make_unique<DevBuf>(size_t(E) * 4);
    goff = std::make_unique<DevBuf>(size_t(E + 1) * 4);
    toff = std::make_unique<DevBuf>(size_t(E + 1) * 4);
    tailoff = std::make_unique<DevBuf>(size_t(E + 1) * 4);
    sorted = std::make_unique<DevBuf>(size_t(T * k) * 4);
    KCUDA(cudaMemset(idx->p, 0xff, idx->n));
    KCUDA(cudaMemset(sorted->p, 0xff, sorted->n));
    KCUDA(cudaMemset(counts->p, 0xff, counts->n));
    KCUDA(cudaMemset(goff->p, 0xff, goff->n));
    KCUDA(cudaMemset(toff->p, 0xff, toff->n));
    KCUDA(cudaMemset(tailoff->p, 0xff, tailoff->n));
    a.T = T;
    a.E = E;
    a.topk = k;
    a.topk_idx = idx->as<int>();
    a.topk_w = w->as<float>();
    a.counts = counts->as<int>();
    a.group_off = goff->as<int>();
    a.tile_off = toff->as<int>();
    a.tail_off = tailoff->as<int>();
    a.sorted = sorted->as<int>();
  }
};

void check_route(const std::vector<float>& logits, int64_t T, int E, int k, const std::string& what,
                 int bm = kPrefillBM) {
  const HostRoute want = host_route(logits, T, E, k);
  auto dl = to_dev(logits);
  DevRoute r(T, E, k);
  r.a.logits = dl->as<float>();
  r.a.bm = bm;
  moe_route(r.a, nullptr);
  const auto idx = to_host<int>(*r.idx, size_t(T * k));
  const auto w = to_host<float>(*r.w, size_t(T * k));
  const auto counts = to_host<int>(*r.counts, size_t(E));
  const auto goff = to_host<int>(*r.goff, size_t(E + 1));
  const auto toff = to_host<int>(*r.toff, size_t(E + 1));
  const auto sorted = to_host<int>(*r.sorted, size_t(T * k));
  ASSERT_EQ(idx, want.idx) << what << ": selected experts differ";
  expect_close(w, want.w, 1e-6f, 1e-5f, what + " weights");
  std::vector<int> wc(size_t(E), 0);
  for (int e : want.idx) ++wc[size_t(e)];
  ASSERT_EQ(counts, wc) << what << ": counts";
  int off = 0, toffs = 0;
  for (int e = 0; e < E; ++e) {
    ASSERT_EQ(goff[size_t(e)], off) << what << ": group_off " << e;
    ASSERT_EQ(toff[size_t(e)], toffs) << what << ": tile_off " << e;
    // Slots of expert e, ascending.
    std::vector<int> exp_slots;
    for (int64_t s = 0; s < T * k; ++s)
      if (want.idx[size_t(s)] == e) exp_slots.push_back(int(s));
    std::vector<int> got(sorted.begin() + off, sorted.begin() + off + wc[size_t(e)]);
    ASSERT_EQ(got, exp_slots) << what << ": sorted slots of expert " << e;
    off += wc[size_t(e)];
    toffs += (wc[size_t(e)] + bm - 1) / bm;
  }
  ASSERT_EQ(goff[size_t(E)], off);
  ASSERT_EQ(toff[size_t(E)], toffs);
  EXPECT_LE(toffs, moe_max_tiles(T, k, E, bm));
}

TEST(PrefillMoe, RoutingMatchesCpuAndSortsByExpert) {
  REQUIRE_GPU();
  std::mt19937 g(7);
  for (int64_t T : {1, 7, 63, 64, 65, 1000, 4096}) {
    auto logits = randv(size_t(T * 256), g, -4.f, 4.f);
    check_route(logits, T, 256, 8, fmt::format("route random T={}", T));
    check_route(logits, T, 256, 8, fmt::format("route random T={} (128-row tiles)", T), 128);
  }
  // All tokens on the same 8 experts (248 experts with zero tokens), with exact ties inside.
  {
    const int64_t T = 1000;
    auto logits = randv(size_t(T * 256), g, -1.f, 1.f);
    for (int64_t t = 0; t < T; ++t)
      for (int e : {3, 17, 40, 41, 100, 128, 200, 255}) logits[size_t(t * 256 + e)] = 20.f + float(e % 3);
    check_route(logits, T, 256, 8, "route all tokens on 8 experts");
  }
  // Exact ties everywhere: the lower index wins, as on the CPU.
  {
    std::vector<float> logits(size_t(65 * 256), 0.5f);
    check_route(logits, 65, 256, 8, "route all-equal logits");
  }
}

// ---------------------------------------------------------------------------------------------
// Whole MoE block against cpu::moe. Expert weights are built once per format and reused.
struct MoeSet {
  WFormat f;
  int E;
  std::unique_ptr<HostMat> gate, up, down, sg, su, sd, seg;
  std::unique_ptr<DevMat> dgate, dup, ddown, dsg, dsu, dsd, dseg;
  MoeSet(WFormat f_, int E_, std::mt19937& g) : f(f_), E(E_) {
    const int64_t H = 2048, I = 512, Is = 512;
    gate = make_mat(f, E * I, H, g);
    up = make_mat(f, E * I, H, g);
    down = make_mat(f, E * H, I, g);
    sg = make_mat(f, Is, H, g);
    su = make_mat(f, Is, H, g);
    sd = make_mat(f, H, Is, g);
    seg = make_mat(WFormat::BF16, 1, H, g);
    dgate = to_dev(gate->m);
    dup = to_dev(up->m);
    ddown = to_dev(down->m);
    dsg = to_dev(sg->m);
    dsu = to_dev(su->m);
    dsd = to_dev(sd->m);
    dseg = to_dev(seg->m);
  }
};

// one_direction: all tokens pick experts 0..7 (every other expert receives zero tokens).
void run_moe(const MoeSet& ms, int64_t T, bool one_direction, uint32_t seed,
             PrefillAPrec aprec = PrefillAPrec::Split, int moe_bm = 0,
             PrefillGemmKernel kern = PrefillGemmKernel::Reg) {
  std::mt19937 g(seed);
  ModelConfig cfg;
  cfg.hidden_size = 2048;
  cfg.num_experts = ms.E;
  cfg.num_experts_per_tok = 8;
  cfg.moe_intermediate_size = 512;
  cfg.shared_expert_intermediate_size = 512;
  const int64_t H = 2048, I = 512, Is = 512, E = ms.E;
  // h is bf16-representable (the router then sees identical inputs on both sides, so top-k
  // near-ties cannot flip through activation rounding); the router is bf16 for the same reason.
  std::vector<float> h = bf16_round(randv(size_t(T * H), g, -1.f, 1.f));
  auto router = make_mat(WFormat::BF16, E, H, g, 0.05f);
  if (one_direction) {
    std::vector<float> u = bf16_round(randv(size_t(H), g, -1.f, 1.f));
    double uu = 0;
    for (float x : u) uu += double(x) * x;
    auto* rw = reinterpret_cast<uint16_t*>(router->data.data());
    for (int e = 0; e < 8; ++e)
      for (int64_t k = 0; k < H; ++k) rw[e * H + k] = f32_to_bf16(float(u[size_t(k)] * 20.0 / uu));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < H; ++k)
        h[size_t(t * H + k)] = round_bf16(u[size_t(k)] + 0.05f * h[size_t(t * H + k)]);
  }
  MoeWeights mw;
  mw.router = router->m;
  for (int64_t e = 0; e < E; ++e) {
    mw.gate.push_back(ms.gate->m.slice_rows(e * I, I));
    mw.up.push_back(ms.up->m.slice_rows(e * I, I));
    mw.down.push_back(ms.down->m.slice_rows(e * H, H));
  }
  mw.shared_gate = ms.sg->m;
  mw.shared_up = ms.su->m;
  mw.shared_down = ms.sd->m;
  mw.shared_expert_gate = ms.seg->m;
  std::vector<float> want(size_t(T * H));
  cpu::moe(mw, cfg, h.data(), T, want.data());

  auto drouter = to_dev(router->m);
  MoePrefillWeights w;
  w.router = drouter->d;
  w.gate = ms.dgate->d;
  w.up = ms.dup->d;
  w.down = ms.ddown->d;
  w.shared_gate = ms.dsg->d;
  w.shared_up = ms.dsu->d;
  w.shared_down = ms.dsd->d;
  w.shared_expert_gate = ms.dseg->d;
  w.E = ms.E;
  w.topk = 8;
  w.hidden = H;
  w.I = I;
  w.Is = Is;
  const int64_t S = T * 8;
  auto logits = poisoned(size_t(T * E));
  DevRoute r(T, ms.E, 8);
  auto act = poisoned(size_t(S * I)), slot_out = poisoned(size_t(S * H));
  auto sact = poisoned(size_t(T * Is)), shared = poisoned(size_t(T * H)), sgt = poisoned(size_t(T));
  MoePrefillScratch sc;
  sc.logits = logits->as<float>();
  sc.topk_idx = r.a.topk_idx;
  sc.topk_w = r.a.topk_w;
  sc.counts = r.a.counts;
  sc.group_off = r.a.group_off;
  sc.tile_off = r.a.tile_off;
  sc.tail_off = r.a.tail_off;
  sc.sorted = r.a.sorted;
  sc.act = act->as<float>();
  sc.slot_out = slot_out->as<float>();
  sc.sact = sact->as<float>();
  sc.shared = shared->as<float>();
  sc.sgate = sgt->as<float>();
  DevBuf flag(16);
  KCUDA(cudaMemset(flag.p, 0, 16));
  sc.aprec = aprec;
  sc.range_flag = flag.as<unsigned>();
  sc.moe_bm = moe_bm;
  const bool pipe = kern == PrefillGemmKernel::Pipe;
  const PipeBufs p0(pipe ? T : 0, std::max(H, Is)), p1(pipe ? S : 0, I);
  if (pipe) {
    sc.kernel = kern;
    sc.pipe[0] = {p0.hi->as<uint16_t>(), p0.lo->as<uint16_t>(), p0.sum->as<float>(), T * std::max(H, Is)};
    sc.pipe[1] = {p1.hi->as<uint16_t>(), p1.lo->as<uint16_t>(), p1.sum->as<float>(), S * I};
  }
  auto dh = to_dev(h);
  // accumulate = true onto a random residual: out = x + MoE(h).
  auto resid = randv(want.size(), g);
  auto dout = to_dev(resid);
  moe_prefill(w, dh->as<float>(), T, sc, dout->as<float>(), true, nullptr);
  auto got = to_host<float>(*dout, want.size());
  for (size_t i = 0; i < got.size(); ++i) got[i] -= resid[i];
  const bool f16 = aprec == PrefillAPrec::F16;
  const std::string what = fmt::format("moe_prefill {} E={} T={}{} {} tile {}", wformat_name(ms.f), ms.E,
                                       T, one_direction ? " (all tokens on experts 0..7)" : "",
                                       f16 ? "f16" : pipe ? "pipe" : "split", moe_bm);
  const bool dq = pipe && prefill_pipe_q4_mma() == PipeMma::Dq;
  EXPECT_LT(rel_err(got, want, (what + (dq ? " dq" : "")).c_str()), f16 ? 2e-3 : dq ? kDqBound : 1e-4)
      << what << (dq ? " dq" : "");
  EXPECT_EQ(to_host<unsigned>(flag, 1)[0], 0u) << what << ": range flag set";
  if (one_direction) {
    const auto counts = to_host<int>(*r.counts, size_t(E));
    for (int e = 0; e < E; ++e) EXPECT_EQ(counts[size_t(e)], e < 8 ? T : 0) << what << " expert " << e;
  }
  // Deterministic: a second run gives bit-identical results.
  auto dout2 = to_dev(resid);
  moe_prefill(w, dh->as<float>(), T, sc, dout2->as<float>(), true, nullptr);
  auto got2 = to_host<float>(*dout2, want.size());
  for (size_t i = 0; i < got2.size(); ++i) got2[i] -= resid[i];
  EXPECT_EQ(std::memcmp(got.data(), got2.data(), got.size() * 4), 0) << what << ": not deterministic";
}

TEST(PrefillMoe, BlockMatchesCpuQ4FullExperts) {
  REQUIRE_GPU();
  std::mt19937 g(300);
  const MoeSet ms(WFormat::Q4, 256, g);
  uint32_t seed = 301;
  for (PrefillAPrec r : kRoutes) {
    for (int64_t T : {1, 7, 65, 1000}) run_moe(ms, T, false, seed++, r);
    run_moe(ms, 300, true, seed++, r);
  }
  // The F16 route with 64-row expert tiles (its default is 128).
  run_moe(ms, 1000, false, seed++, PrefillAPrec::F16, 64);
  run_moe(ms, 300, true, seed++, PrefillAPrec::F16, 64);
}

TEST(PrefillMoe, BlockMatchesCpuBf16AndQ8) {
  REQUIRE_GPU();
  std::mt19937 g(400);
  uint32_t seed = 401;
  for (PrefillAPrec r : kRoutes) {
    {
      const MoeSet ms(WFormat::BF16, 32, g);
      run_moe(ms, 63, false, seed++, r);
      run_moe(ms, 200, true, seed++, r);
    }
    const MoeSet ms(WFormat::Q8, 32, g);
    run_moe(ms, 64, false, seed++, r);
  }
}

// ---------------------------------------------------------------------------------------------
// The Pipe kernel (prefill_pipe.cu): the split itself, then every GEMM shape and epilogue the
// prompt driver gives it, and the MoE block with the kernel on, against the same oracle and bound
// as the Reg kernel's Split route.
TEST(PrefillPipe, SplitPlanesAndGroupSums) {
  REQUIRE_GPU();
  std::mt19937 g(600);
  for (int64_t rows : {1, 3, 65}) {
    const int64_t K = 512, lda = 520;  // padded rows: lda > K
    auto x = randv(size_t(rows * lda), g, -3.f, 3.f);
    x[5] = 1e30f;  // beyond bf16's precision range: lo carries the rest
    x[6] = -1.2345e-20f;
    auto dx = to_dev(x);
    const PipeBufs pb(rows, K);
    pb.split(dx->as<float>(), rows, K, lda);
    const auto hi = to_host<uint16_t>(*pb.hi, size_t(rows * K));
    const auto lo = to_host<uint16_t>(*pb.lo, size_t(rows * K));
    const auto sum = to_host<float>(*pb.sum, size_t(rows * K / 64));
    {  // the hi plane alone (lo = sum = nullptr, the Dq kernel's split): the same hi
      auto hi_only = poisoned16(size_t(rows * K));
      PipeSplitArgs a;
      a.A = dx->as<float>();
      a.rows = rows;
      a.K = K;
      a.lda = lda;
      a.hi = hi_only->as<uint16_t>();
      prefill_pipe_split(a, nullptr);
      EXPECT_EQ(to_host<uint16_t>(*hi_only, size_t(rows * K)), hi) << "rows " << rows;
      a.sum = pb.sum->as<float>();  // lo and sum: both or neither
      EXPECT_THROW(prefill_pipe_split(a, nullptr), Error);
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t pos = 0; pos < K; ++pos) {
        const int64_t c = pos / 32, o = pos % 32, s = o / 16, kp = o % 16;
        const int64_t src = 32 * c + 8 * ((kp & 7) >> 1) + 2 * s + (kp >= 8) + 4 * (kp & 1);
        const float a = x[size_t(r * lda + src)];
        const float got = bf16_to_f32(hi[size_t(r * K + pos)]) + bf16_to_f32(lo[size_t(r * K + pos)]);
        ASSERT_LE(std::fabs(got - a), std::fabs(a) * 0x1p-16f) << "row " << r << " pos " << pos;
      }
      for (int64_t q = 0; q < K / 64; ++q) {
        double want = 0, mag = 0;
        for (int64_t k = 0; k < 64; ++k) {
          want += x[size_t(r * lda + 64 * q + k)];
          mag += std::fabs(x[size_t(r * lda + 64 * q + k)]);
        }
        EXPECT_LE(std::fabs(sum[size_t(r * K / 64 + q)] - want), 1e-6 * mag) << "row " << r << " group " << q;
      }
    }
  }
}

TEST(PrefillPipe, DenseMatchesCpu) {
  REQUIRE_GPU();
  constexpr auto P = PrefillGemmKernel::Pipe;
  constexpr auto S = PrefillAPrec::Split;
  uint32_t seed = 610;
  for (WFormat f : {WFormat::BF16, WFormat::Q4})
    for (int64_t M : {1, 7, 63, 64, 65, 127, 128, 129, 1000})
      run_gemm(f, M, 200, 512, GemmEpi::Store, seed++, false, S, P);
  // The real widths: K 2048 (hidden) and 4096 (out_proj / o_proj), N off the 128-column tile,
  // N = 1 (shared_expert_gate), a full 4096-token chunk.
  run_gemm(WFormat::Q4, 4096, 264, 2048, GemmEpi::Store, seed++, false, S, P);
  run_gemm(WFormat::Q4, 4096, 4096, 2048, GemmEpi::Store, seed++, false, S, P);
  run_gemm(WFormat::Q4, 1000, 2048, 4096, GemmEpi::Store, seed++, false, S, P);
  run_gemm(WFormat::BF16, 4096, 130, 4096, GemmEpi::Store, seed++, false, S, P);
  run_gemm(WFormat::BF16, 2048, 4096, 2048, GemmEpi::Store, seed++, false, S, P);
  run_gemm(WFormat::Q4, 65, 1, 2048, GemmEpi::Store, seed++, false, S, P);
  run_gemm(WFormat::BF16, 65, 1, 2048, GemmEpi::Store, seed++, false, S, P);
}

TEST(PrefillPipe, ResidualAndSiluMulEpilogues) {
  REQUIRE_GPU();
  constexpr auto P = PrefillGemmKernel::Pipe;
  constexpr auto S = PrefillAPrec::Split;
  uint32_t seed = 650;
  for (WFormat f : {WFormat::BF16, WFormat::Q4}) {
    run_gemm(f, 65, 2048, 512, GemmEpi::Residual, seed++, false, S, P);
    run_gemm(f, 1000, 2048, 4096, GemmEpi::Residual, seed++, false, S, P);
    run_gemm(f, 1000, 512, 2048, GemmEpi::SiluMul, seed++, false, S, P);
    run_gemm(f, 4096, 512, 2048, GemmEpi::SiluMul, seed++, false, S, P);
    run_gemm(f, 7, 100, 2048, GemmEpi::SiluMul, seed++, false, S, P);
  }
}

TEST(PrefillPipe, RejectsWhatItDoesNotTake) {
  REQUIRE_GPU();
  std::mt19937 g(5);
  DevBuf x(64 * 1024 * 4), y(64 * 64 * 4);
  const PipeBufs pb(64, 1024);
  const PipeA pa = pb.split(x.as<float>(), 64, 512, 512);
  auto args = [&](const DevMat& w, int64_t K) {
    PrefillGemmArgs a;
    a.M = 64;
    a.N = 64;
    a.K = K;
    a.pipe = pa;
    a.W = w.d;
    a.C = y.as<float>();
    a.ldc = 64;
    return a;
  };
  auto q8 = make_mat(WFormat::Q8, 64, 512, g);
  auto dq8 = to_dev(q8->m);
  EXPECT_THROW(prefill_gemm(args(*dq8, 512), nullptr), Error);  // Q8: Reg only
  auto q4 = make_mat(WFormat::Q4, 64, 576, g);
  auto dq4 = to_dev(q4->m);
  EXPECT_THROW(prefill_gemm(args(*dq4, 576), nullptr), Error);  // K % 512 != 0
  auto q4b = make_mat(WFormat::Q4, 64, 1024, g);
  auto dq4b = to_dev(q4b->m);
  EXPECT_THROW(prefill_gemm(args(*dq4b, 1024), nullptr), Error);  // A split for K 512
  auto a = args(*dq4b, 1024);
  a.pipe = pb.split(x.as<float>(), 64, 1024, 1024);
  EXPECT_NO_THROW(prefill_gemm(a, nullptr));
  a.A = x.as<float>();  // two A given
  a.lda = 1024;
  EXPECT_THROW(prefill_gemm(a, nullptr), Error);
  a.A = nullptr;
  a.aprec = PrefillAPrec::F16;  // the Pipe kernel is the Split route
  EXPECT_THROW(prefill_gemm(a, nullptr), Error);
  KCUDA(cudaDeviceSynchronize());
}

// The Q4 Pipe GEMMs above run on the default (auto: pp for K >= 1024, wgmma below); the same shapes
// on the other Q4 kernels (KESTREL_PIPE_MMA=sync | wgmma | ws | rs | pp), and the switch's refusal
// of anything else.
struct PipeMmaEnv : ScopedEnv {
  explicit PipeMmaEnv(const char* v) : ScopedEnv("KESTREL_PIPE_MMA", v) {}
};

void run_pipe_q4_shapes(uint32_t seed) {
  constexpr auto P = PrefillGemmKernel::Pipe;
  constexpr auto S = PrefillAPrec::Split;
  // 1 row (the second 64-row half of the tile empty), 65 and 129 (partial halves), 1000; K 512 is
  // one block of 8 k-tiles, K 4096 eight.
  for (int64_t M : {1, 65, 129, 1000}) run_gemm(WFormat::Q4, M, 200, 512, GemmEpi::Store, seed++, false, S, P);
  run_gemm(WFormat::Q4, 1000, 2048, 4096, GemmEpi::Residual, seed++, false, S, P);
  run_gemm(WFormat::Q4, 1000, 512, 2048, GemmEpi::SiluMul, seed++, false, S, P);
  run_gemm(WFormat::Q4, 63, 8192, 2048, GemmEpi::Store, seed++, false, S, P);
  std::mt19937 g(seed);
  const MoeSet ms(WFormat::Q4, 256, g);
  run_moe(ms, 300, true, seed++, S, 0, P);
  run_moe(ms, 1000, false, seed++, S, 0, P);
}

TEST(PrefillPipe, Q4OnMmaSync) {
  REQUIRE_GPU();
  {
    const PipeMmaEnv e("bogus");
    EXPECT_THROW(prefill_pipe_q4_mma(), Error);
  }
  EXPECT_EQ(prefill_pipe_q4_mma(), PipeMma::Auto);
  EXPECT_EQ(pipe_mma_for(PipeMma::Auto, 512), PipeMma::Wgmma);
  EXPECT_EQ(pipe_mma_for(PipeMma::Auto, 2048), PipeMma::Pp);
  EXPECT_EQ(pipe_mma_for(PipeMma::Auto, 4096), PipeMma::Pp);
  EXPECT_EQ(pipe_mma_for(PipeMma::Sync, 2048), PipeMma::Sync);
  const PipeMmaEnv e("sync");
  ASSERT_EQ(prefill_pipe_q4_mma(), PipeMma::Sync);
  run_pipe_q4_shapes(680);
}

// The wgmma kernel at every K (the default takes it for K < 1024 only).
TEST(PrefillPipe, Q4OnWgmma) {
  REQUIRE_GPU();
  const PipeMmaEnv e("wgmma");
  ASSERT_EQ(prefill_pipe_q4_mma(), PipeMma::Wgmma);
  run_pipe_q4_shapes(5680);
}

// The transposed kernel (weights as wgmma's register operand): its own row order of gate|up and
// its staged epilogue, on the same shapes.
TEST(PrefillPipe, Q4OnTransposedWgmma) {
  REQUIRE_GPU();
  const PipeMmaEnv e("rs");
  ASSERT_EQ(prefill_pipe_q4_mma(), PipeMma::Rs);
  run_pipe_q4_shapes(3680);
}

// Its MoE tail tiles (KESTREL_PIPE_RS_TAIL=1): an expert's last count % 128 rows, when at most 64,
// on a 64-token tile. 300 tokens all on experts 0..7: 2 tiles + a 44-row tail each; 1000 tokens
// over 32 experts: remainders on both sides of 64; over 256: every expert below 128 rows (tails
// and single partial tiles), some with none.
TEST(PrefillPipe, Q4OnTransposedWgmmaTailTiles) {
  REQUIRE_GPU();
  const PipeMmaEnv e("rs");
  {
    const ScopedEnv b("KESTREL_PIPE_RS_TAIL", "2");
    EXPECT_THROW(prefill_pipe_rs_tail(), Error);
  }
  EXPECT_FALSE(prefill_pipe_rs_tail());
  const ScopedEnv t("KESTREL_PIPE_RS_TAIL", "1");
  ASSERT_TRUE(prefill_pipe_rs_tail());
  constexpr auto P = PrefillGemmKernel::Pipe;
  constexpr auto S = PrefillAPrec::Split;
  std::mt19937 g(4680);
  uint32_t seed = 4681;
  {
    const MoeSet ms(WFormat::Q4, 32, g);
    run_moe(ms, 1000, false, seed++, S, 0, P);
    run_moe(ms, 300, true, seed++, S, 0, P);
  }
  const MoeSet ms(WFormat::Q4, 256, g);
  run_moe(ms, 1000, false, seed++, S, 0, P);
  run_moe(ms, 300, true, seed++, S, 0, P);
}

// The exact numbers in the dequantising kernel's pipeline (KESTREL_PIPE_MMA=pp: two product sets,
// each k-tile folded while the next one's wgmma run), on the same shapes and the exact bound.
TEST(PrefillPipe, Q4OnPp) {
  REQUIRE_GPU();
  const PipeMmaEnv e("pp");
  ASSERT_EQ(prefill_pipe_q4_mma(), PipeMma::Pp);
  run_pipe_q4_shapes(7680);
  run_gemm(WFormat::Q4, 4096, 264, 2048, GemmEpi::Store, 7700, false, PrefillAPrec::Split, PrefillGemmKernel::Pipe);
  run_gemm(WFormat::Q4, 129, 2048, 512, GemmEpi::Residual, 7701, false, PrefillAPrec::Split, PrefillGemmKernel::Pipe);
  // bf16 weights take the mma.sync kernel under this switch, exact as well
  run_gemm(WFormat::BF16, 65, 200, 512, GemmEpi::Store, 7702, false, PrefillAPrec::Split, PrefillGemmKernel::Pipe);
}

// The warp-specialised kernel on both of its grids: persistent (the default; fewer blocks than
// tiles, so every block runs several tiles through the same ring) and one block per tile.
TEST(PrefillPipe, Q4OnWarpSpecialisedWgmma) {
  REQUIRE_GPU();
  const PipeMmaEnv e("ws");
  ASSERT_EQ(prefill_pipe_q4_mma(), PipeMma::Ws);
  ASSERT_EQ(prefill_pipe_ws_grid(), PipeWsGrid::Persistent);
  run_pipe_q4_shapes(1680);
  {
    const ScopedEnv b("KESTREL_PIPE_WS_GRID", "bogus");
    EXPECT_THROW(prefill_pipe_ws_grid(), Error);
  }
  const ScopedEnv t("KESTREL_PIPE_WS_GRID", "tiles");
  ASSERT_EQ(prefill_pipe_ws_grid(), PipeWsGrid::Tiles);
  run_pipe_q4_shapes(2680);
}

// The dequantising kernel (KESTREL_PIPE_MMA=dq): Q4 and bf16 weights, the same shapes as the
// other Q4 kernels, bf16 weights at the real widths, and the MoE block with Q4 and bf16 experts
// (the router, where the block computes it, stays exact on the Reg kernel).
TEST(PrefillPipe, DqQ4AndBf16) {
  REQUIRE_GPU();
  const PipeMmaEnv e("dq");
  ASSERT_EQ(prefill_pipe_q4_mma(), PipeMma::Dq);
  run_pipe_q4_shapes(5680);
  constexpr auto P = PrefillGemmKernel::Pipe;
  constexpr auto S = PrefillAPrec::Split;
  uint32_t seed = 5700;
  for (int64_t M : {1, 65, 129, 1000}) run_gemm(WFormat::BF16, M, 200, 512, GemmEpi::Store, seed++, false, S, P);
  run_gemm(WFormat::BF16, 4096, 130, 4096, GemmEpi::Store, seed++, false, S, P);
  run_gemm(WFormat::BF16, 1000, 2048, 4096, GemmEpi::Residual, seed++, false, S, P);
  run_gemm(WFormat::BF16, 1000, 512, 2048, GemmEpi::SiluMul, seed++, false, S, P);
  run_gemm(WFormat::BF16, 65, 1, 2048, GemmEpi::Store, seed++, false, S, P);
  std::mt19937 g(seed);
  const MoeSet ms(WFormat::BF16, 32, g);
  run_moe(ms, 200, true, seed++, S, 0, P);
  run_moe(ms, 1000, false, seed++, S, 0, P);
}

// Its 128 x 256 Q4 tiles (KESTREL_PIPE_DQ_N=256: m64n256 per warpgroup, 128 outputs of gate|up
// per block), the same shapes.
TEST(PrefillPipe, DqWideQ4) {
  REQUIRE_GPU();
  const PipeMmaEnv e("dq");
  {
    const ScopedEnv b("KESTREL_PIPE_DQ_N", "512");
    EXPECT_THROW(prefill_pipe_dq_wide(), Error);
  }
  EXPECT_FALSE(prefill_pipe_dq_wide());
  const ScopedEnv w("KESTREL_PIPE_DQ_N", "256");
  ASSERT_TRUE(prefill_pipe_dq_wide());
  run_pipe_q4_shapes(6680);
  run_gemm(WFormat::Q4, 300, 300, 512, GemmEpi::SiluMul, 6700, false, PrefillAPrec::Split, PrefillGemmKernel::Pipe);
}

TEST(PrefillPipe, MoeBlockMatchesCpu) {
  REQUIRE_GPU();
  constexpr auto P = PrefillGemmKernel::Pipe;
  constexpr auto S = PrefillAPrec::Split;
  std::mt19937 g(700);
  uint32_t seed = 701;
  {
    const MoeSet ms(WFormat::Q4, 256, g);
    for (int64_t T : {1, 7, 65, 1000}) run_moe(ms, T, false, seed++, S, 0, P);
    run_moe(ms, 300, true, seed++, S, 0, P);
  }
  {
    const MoeSet ms(WFormat::BF16, 32, g);
    run_moe(ms, 63, false, seed++, S, 0, P);
    run_moe(ms, 200, true, seed++, S, 0, P);
  }
  // Q8 experts: the Pipe kernel does not take them; the block runs them on Reg (and is exact).
  const MoeSet ms(WFormat::Q8, 32, g);
  run_moe(ms, 64, false, seed++, S, 0, P);
}

// ---------------------------------------------------------------------------------------------
// Conv + chunked Gated DeltaNet against conv1d_silu and the token-by-token recurrence.
TEST(PrefillGdn, ConvMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 g(11);
  const int64_t C = 8192;
  // Runs of 16 tokens per thread: windows from the state (T < 3), across runs, partial last runs.
  for (int64_t T : {1, 2, 7, 16, 17, 65, 1000}) {
    auto x = randv(size_t(T * C), g);
    auto w = randv(size_t(C * 4), g);
    auto st = randv(size_t(C * 3), g);
    std::vector<float> want(size_t(T * C)), wst = st;
    cpu::conv1d_silu(x.data(), T, C, 4, w.data(), wst.data(), want.data());
    auto dx = to_dev(x), dw = to_dev(w), dst = to_dev(st);
    auto du = poisoned(want.size());
    PrefillConvArgs a;
    a.T = T;
    a.C = C;
    a.x = dx->as<float>();
    a.ldx = C;
    a.w = dw->as<float>();
    a.state = dst->as<float>();
    a.u = du->as<float>();
    prefill_conv(a, nullptr);
    const std::string what = fmt::format("prefill_conv T={}", T);
    expect_close(to_host<float>(*du, want.size()), want, 1e-6f, 1e-5f, what);
    expect_close(to_host<float>(*dst, wst.size()), wst, 0.f, 0.f, what + " state");
  }
}

void run_gdn(int64_t T, uint32_t seed) {
  std::mt19937 g(seed);
  const int Hk = 16, Hv = 32, dk = 128, dv = 128;
  const int64_t ldu = 2 * Hk * dk + Hv * dv;  // 8192
  auto u = randv(size_t(T * ldu), g);
  auto b = randv(size_t(T * Hv), g, -3.f, 3.f);
  auto av = randv(size_t(T * Hv), g, -3.f, 3.f);
  auto A_log = randv(size_t(Hv), g, -6.f, 0.5f);
  auto dtb = randv(size_t(Hv), g, -1.f, 1.f);
  auto S0 = randv(size_t(Hv) * dv * dk, g, -0.5f, 0.5f);  // [Hv, dv, dk]
  // Oracle inputs.
  std::vector<float> q(size_t(T * Hk * dk)), k(size_t(T * Hk * dk)), v(size_t(T * Hv * dv)),
      beta(size_t(T * Hv)), gg(size_t(T * Hv));
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(u.begin() + t * ldu, Hk * dk, q.begin() + t * Hk * dk);
    std::copy_n(u.begin() + t * ldu + Hk * dk, Hk * dk, k.begin() + t * Hk * dk);
    std::copy_n(u.begin() + t * ldu + 2 * Hk * dk, Hv * dv, v.begin() + t * Hv * dv);
    for (int j = 0; j < Hv; ++j) {
      beta[size_t(t * Hv + j)] = cpu::sigmoid(b[size_t(t * Hv + j)]);
      gg[size_t(t * Hv + j)] =
          -std::exp(A_log[size_t(j)]) * cpu::softplus(av[size_t(t * Hv + j)] + dtb[size_t(j)]);
    }
  }
  cpu::l2norm_rows(q.data(), T * Hk, dk, 1e-6f, 1.f / std::sqrt(float(dk)));
  cpu::l2norm_rows(k.data(), T * Hk, dk, 1e-6f, 1.f);
  std::vector<float> S(S0.size());  // CPU layout [Hv, dk, dv]
  for (int j = 0; j < Hv; ++j)
    for (int i = 0; i < dv; ++i)
      for (int r = 0; r < dk; ++r)
        S[(size_t(j) * dk + r) * dv + i] = S0[(size_t(j) * dv + i) * dk + r];
  std::vector<float> want(size_t(T * Hv * dv));
  cpu::gdn_recurrent({Hk, Hv, dk, dv}, T, q.data(), k.data(), v.data(), beta.data(), gg.data(),
                     S.data(), want.data());
  std::vector<float> wantS(S.size());
  for (int j = 0; j < Hv; ++j)
    for (int i = 0; i < dv; ++i)
      for (int r = 0; r < dk; ++r)
        wantS[(size_t(j) * dv + i) * dk + r] = S[(size_t(j) * dk + r) * dv + i];

  auto du = to_dev(u), db = to_dev(b), da = to_dev(av), dA = to_dev(A_log), ddt = to_dev(dtb),
       dS = to_dev(S0);
  auto dout = poisoned(want.size());
  PrefillGdnArgs a;
  a.T = T;
  a.u = du->as<float>();
  a.ldu = ldu;
  a.b = db->as<float>();
  a.a = da->as<float>();
  a.ldb = Hv;
  a.lda = Hv;
  a.A_log = dA->as<float>();
  a.dt_bias = ddt->as<float>();
  a.state = dS->as<float>();
  a.o = dout->as<float>();
  DevBuf scratch(prefill_gdn_scratch_bytes(T, Hv));
  KCUDA(cudaMemset(scratch.p, 0xff, scratch.n));  // poisoned: every chunk product must be written
  a.scratch = scratch.as<float>();
  a.Hk = Hk;
  a.Hv = Hv;
  a.dk = dk;
  a.dv = dv;
  prefill_gdn(a, nullptr);
  const std::string what = fmt::format("prefill_gdn T={}", T);
  EXPECT_LT(rel_err(to_host<float>(*dout, want.size()), want, what.c_str()), 1e-4) << what;
  EXPECT_LT(rel_err(to_host<float>(*dS, wantS.size()), wantS, (what + " state").c_str()), 1e-4) << what;
}

TEST(PrefillGdn, ChunkedMatchesRecurrence) {
  REQUIRE_GPU();
  uint32_t seed = 500;
  for (int64_t T : {1, 7, 63, 64, 65, 1000, 4096}) run_gdn(T, seed++);
}

// ---------------------------------------------------------------------------------------------
// Flash attention against cpu::attention over the same bf16 cache contents.
// route: 0 = Q K^T and P V on wgmma (the default), 1 = Q K^T only, 2 = both on mma.sync,
// 3 = the wide kernel (128 x 64 tiles; P one plane only), 4 = the same with two K buffers.
void run_attn(int64_t T, int64_t pos0, uint32_t seed, bool p_split = true, int route = 0) {
  std::mt19937 g(seed);
  const int H = 16, Hkv = 2, D = 256, rot = 64;
  const int64_t cap = pos0 + T + 5;
  const double theta = 1e7;
  auto qg = randv(size_t(T * H * 2 * D), g, -2.f, 2.f);
  auto kr = randv(size_t(T * Hkv * D), g, -2.f, 2.f);
  auto vr = randv(size_t(T * Hkv * D), g, -2.f, 2.f);
  auto qn = randv(size_t(D), g, 0.5f, 1.5f), kn = randv(size_t(D), g, 0.5f, 1.5f);
  // Existing cache rows 0..pos0-1 (bf16), the rest poisoned.
  std::vector<uint16_t> kc(size_t(cap * Hkv * D), 0xffff), vc(size_t(cap * Hkv * D), 0xffff);
  {
    auto pk = randv(size_t(pos0 * Hkv * D), g, -1.f, 1.f), pv = randv(size_t(pos0 * Hkv * D), g);
    for (size_t i = 0; i < pk.size(); ++i) kc[i] = f32_to_bf16(pk[i]), vc[i] = f32_to_bf16(pv[i]);
  }
  // Oracle: norm + rope, rounded to bf16 as the kernel stores them.
  std::vector<float> q(size_t(T * H * D)), kk(size_t(T * Hkv * D));
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      std::copy_n(qg.begin() + (t * H + h) * 2 * D, D, q.begin() + (t * H + h) * D);
  cpu::rmsnorm(q.data(), qn.data(), T * H, D, kEps, q.data());
  cpu::rmsnorm(kr.data(), kn.data(), T * Hkv, D, kEps, kk.data());
  cpu::rope_neox(q.data(), T, H, D, rot, pos0, theta);
  cpu::rope_neox(kk.data(), T, Hkv, D, rot, pos0, theta);
  q = bf16_round(q);
  std::vector<uint16_t> wkc = kc, wvc = vc;
  for (int64_t i = 0; i < T * Hkv * D; ++i) {
    wkc[size_t(pos0 * Hkv * D + i)] = f32_to_bf16(kk[size_t(i)]);
    wvc[size_t(pos0 * Hkv * D + i)] = f32_to_bf16(vr[size_t(i)]);
  }
  std::vector<float> kf(size_t((pos0 + T) * Hkv * D)), vf(kf.size());
  for (size_t i = 0; i < kf.size(); ++i) kf[i] = bf16_to_f32(wkc[i]), vf[i] = bf16_to_f32(wvc[i]);
  std::vector<float> want(size_t(T * H * D));
  cpu::attention(q.data(), T, pos0, kf.data(), vf.data(), H, Hkv, D, want.data());
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d)
        want[size_t((t * H + h) * D + d)] *= cpu::sigmoid(qg[size_t((t * H + h) * 2 * D + D + d)]);

  auto dqg = to_dev(qg), dk = to_dev(kr), dv = to_dev(vr), dqn = to_dev(qn), dkn = to_dev(kn);
  auto dkc = to_dev(kc), dvc = to_dev(vc);
  auto dq = std::make_unique<DevBuf>(size_t(2 * T * H * D) * 2);  // hi and lo parts
  auto dout = poisoned(want.size());
  PrefillAttnArgs a;
  a.T = T;
  a.pos0 = pos0;
  a.capacity = cap;
  a.qg = dqg->as<float>();
  a.k = dk->as<float>();
  a.v = dv->as<float>();
  a.q_norm = dqn->as<float>();
  a.k_norm = dkn->as<float>();
  a.eps = kEps;
  a.rope_theta = theta;
  a.qbuf = dq->as<uint16_t>();
  a.kcache = dkc->as<uint16_t>();
  a.vcache = dvc->as<uint16_t>();
  a.out = dout->as<float>();
  a.heads = H;
  a.kv_heads = Hkv;
  a.head_dim = D;
  a.rotary_dim = rot;
  a.p_split = p_split;
  a.qk_wgmma = route < 2 || route >= 3;
  a.pv_wgmma = route == 0 || route >= 3;
  a.wide = route >= 3 ? route - 2 : 0;
  prefill_attn(a, nullptr);
  const std::string what = fmt::format("prefill_attn T={} pos0={} p_split={} route={}", T, pos0, p_split, route);
  EXPECT_LT(rel_err(to_host<float>(*dout, want.size()), want, what.c_str()), 1e-2) << what;
  // The cache: rows before pos0 untouched, new rows = normed/roped k and raw v (bf16; at most one
  // rounding step apart where fp32 summation order differs), rows after untouched.
  const auto gk = to_host<uint16_t>(*dkc, kc.size()), gv = to_host<uint16_t>(*dvc, vc.size());
  int bad = 0;
  for (size_t i = 0; i < gk.size(); ++i) {
    const float e = bf16_to_f32(wkc[i]), x = bf16_to_f32(gk[i]);
    const bool poison = wkc[i] == 0xffff;
    if (poison ? gk[i] != 0xffff : !(std::fabs(x - e) <= 1e-2f * std::fabs(e) + 1e-6f)) ++bad;
    if (gv[i] != wvc[i]) ++bad;
  }
  EXPECT_EQ(bad, 0) << what << ": KV cache rows differ";
}

// Q K^T and P V on wgmma (the default), Q K^T only, and both on mma.sync; P split.
TEST(PrefillAttn, FlashMatchesCpu) {
  REQUIRE_GPU();
  for (int wg : {0, 1, 2}) {
    uint32_t seed = 600;
    for (int64_t T : {1, 7, 63, 64, 65, 1000}) run_attn(T, 0, seed++, true, wg);
    run_attn(65, 1000, seed++, true, wg);  // continuing after a cached prefix (chunked prefill)
    run_attn(1, 37, seed++, true, wg);
  }
}

// The wide kernel (KESTREL_ATTN_TILE=128x64, and 128x64k2 with two K buffers): block sizes
// straddling its 128-query blocks, its 64-key tiles and each warpgroup's 64 rows (a warpgroup past
// T, a diagonal tile masked whole for the first warpgroup; 1, 2, 3 and many key tiles, which the
// two-buffer schedule treats apart), after cached prefixes that are and are not tile multiples;
// the switch's parsing and the route combinations it refuses.
TEST(PrefillAttn, FlashWideMatchesCpu) {
  REQUIRE_GPU();
  for (int route : {3, 4}) {
    uint32_t seed = 680;
    for (int64_t T : {1, 2, 63, 64, 65, 127, 128, 129, 192, 300, 1000, 2048}) run_attn(T, 0, seed++, false, route);
    run_attn(65, 1000, seed++, false, route);
    run_attn(1, 37, seed++, false, route);
    run_attn(200, 64, seed++, false, route);
    run_attn(130, 127, seed++, false, route);
  }
  EXPECT_EQ(prefill_attn_wide(), 0);
  {
    const ScopedEnv e("KESTREL_ATTN_TILE", "128x64");
    EXPECT_EQ(prefill_attn_wide(), 1);
  }
  {
    const ScopedEnv e("KESTREL_ATTN_TILE", "128x64k2");
    EXPECT_EQ(prefill_attn_wide(), 2);
  }
  {
    const ScopedEnv e("KESTREL_ATTN_TILE", "64x32");
    EXPECT_EQ(prefill_attn_wide(), 0);
  }
  {
    const ScopedEnv e("KESTREL_ATTN_TILE", "64x64");
    EXPECT_THROW(prefill_attn_wide(), Error);
  }
  // The wide kernel with P split or a mma.sync product: refused by prefill_attn's route check (every
  // other argument valid, so the error is that one).
  auto dbuf = std::make_unique<DevBuf>(size_t(1) << 20);
  float* f = dbuf->as<float>();
  auto* u = reinterpret_cast<uint16_t*>(f + (1 << 17));
  for (int bad = 0; bad < 4; ++bad) {
    PrefillAttnArgs a;
    a.T = 1;
    a.capacity = 1;
    a.heads = 16;
    a.kv_heads = 2;
    a.head_dim = 256;
    a.rotary_dim = 64;
    a.qg = a.k = a.v = a.q_norm = a.k_norm = a.out = f;
    a.qbuf = a.kcache = a.vcache = u;
    a.wide = bad == 3 ? 3 : 1;  // (3: no such kernel)
    a.p_split = bad == 0;
    a.qk_wgmma = bad != 1;
    a.pv_wgmma = bad != 2;
    try {
      prefill_attn(a, nullptr);
      ADD_FAILURE() << "wide kernel accepted route " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(bad == 3 ? "wide 3" : "128x64"), std::string::npos) << e.what();
    }
  }
}

// P as one bf16 plane (the default, KESTREL_ATTN_P=bf16): same bound, the three kernel routes; and the
// switches' parsing (FlashMatchesCpu above runs P split, KESTREL_ATTN_P=split).
TEST(PrefillAttn, FlashBf16PMatchesCpu) {
  REQUIRE_GPU();
  for (int wg : {0, 1, 2}) {
    uint32_t seed = 650;
    for (int64_t T : {1, 64, 65, 1000}) run_attn(T, 0, seed++, false, wg);
    run_attn(65, 1000, seed++, false, wg);
  }
  EXPECT_FALSE(prefill_attn_p_split());
  EXPECT_TRUE(prefill_attn_qk_wgmma());
  EXPECT_TRUE(prefill_attn_pv_wgmma());
  {
    const ScopedEnv e("KESTREL_ATTN_PV", "sync");
    EXPECT_FALSE(prefill_attn_pv_wgmma());
  }
  {
    const ScopedEnv e("KESTREL_ATTN_P", "split");
    EXPECT_TRUE(prefill_attn_p_split());
  }
  {
    const ScopedEnv e("KESTREL_ATTN_P", "bf16");
    EXPECT_FALSE(prefill_attn_p_split());
  }
  {
    const ScopedEnv e("KESTREL_ATTN_P", "bogus");
    EXPECT_THROW(prefill_attn_p_split(), Error);
  }
  {
    const ScopedEnv e("KESTREL_ATTN_QK", "sync");
    EXPECT_FALSE(prefill_attn_qk_wgmma());
  }
  {
    const ScopedEnv e("KESTREL_ATTN_QK", "bogus");
    EXPECT_THROW(prefill_attn_qk_wgmma(), Error);
  }
}

}  // namespace
}  // namespace kestrel::cuda::test
