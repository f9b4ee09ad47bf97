// The prompt step's small kernels (src/cuda/prefill_ops.h) against the CPU oracle at the model's
// real widths, outputs poisoned (NaN) first: [T, 2048] RMSNorm (fp32 and bf16 out), the GDN gated
// RMSNorm (32 heads x 128), the embedding gather (bit-exact), the sequence-end counters, and the
// exact fp32 GEMM (router 256 x 2048, lm_head-like 1 x 4100 rows; 1e-5 relative, and the same
// top-8 / argmax as the CPU wherever the CPU's choice is not within 1e-5 of a tie).
#include "core/config.h"
#include "cpu/ops.h"
#include "cuda/prefill.h"
#include "cuda/prefill_ops.h"
#include "util.h"

#include <algorithm>
#include <limits>
#include <numeric>

namespace kestrel::cuda::test {
namespace {

constexpr float kEps = 1e-6f;

std::vector<float> from_bf16(const std::vector<uint16_t>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = bf16_to_f32(v[i]);
  return r;
}
// |a - e| <= 1 bf16 ulp of e (2^-8 relative) + atol, printing the first violation.
void expect_bf16_of(const std::vector<float>& got, const std::vector<float>& want, float atol,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= atol + std::fabs(want[i]) * (1.f / 256.f))) {
      ADD_FAILURE() << what << ": first bad index " << i << ": got " << got[i] << ", expected bf16 of "
                    << want[i];
      return;
    }
}

TEST(PrefillOps, RmsNormRowsMatchesCpu) {
  REQUIRE_GPU();
  const int64_t n = 2048;
  for (int64_t T : {1, 7, 64, 65, 300}) {
    std::mt19937 g(uint32_t(T) + 11);
    const int64_t ldx = n + 64;  // a strided input (the last row of a chunk is read in place)
    auto x = randv(size_t(T * ldx), g, -3.f, 3.f);
    auto w = randv(size_t(n), g, 0.5f, 1.5f);
    std::vector<float> xd(size_t(T * n)), want(size_t(T * n));
    for (int64_t t = 0; t < T; ++t)
      std::copy_n(x.begin() + t * ldx, n, xd.begin() + t * n);
    cpu::rmsnorm(xd.data(), w.data(), T, n, kEps, want.data());
    auto dx = to_dev(x), dw = to_dev(w);
    auto dy = poisoned(size_t(T * n));
    auto dy16 = poisoned16(size_t(T * n));
    PrefillRmsNormArgs a;
    a.T = T;
    a.n = n;
    a.x = dx->as<float>();
    a.ldx = ldx;
    a.w = dw->as<float>();
    a.eps = kEps;
    a.y = dy->as<float>();
    a.ldy = n;
    a.y16 = dy16->as<uint16_t>();
    a.ldy16 = n;
    prefill_rmsnorm(a, nullptr);
    const auto got = to_host<float>(*dy, want.size());
    const std::string what = fmt::format("prefill_rmsnorm T={}", T);
    expect_close(got, want, 1e-6f, 1e-5f, what + " fp32");
    expect_bf16_of(from_bf16(to_host<uint16_t>(*dy16, want.size())), want, 1e-6f, what + " bf16");
    // bf16 only.
    auto dz16 = poisoned16(size_t(T * n));
    a.y = nullptr;
    a.y16 = dz16->as<uint16_t>();
    prefill_rmsnorm(a, nullptr);
    expect_bf16_of(from_bf16(to_host<uint16_t>(*dz16, want.size())), want, 1e-6f, what + " bf16 only");
  }
}

TEST(PrefillOps, GatedNormMatchesCpu) {
  REQUIRE_GPU();
  const int Hv = 32, dv = 128;
  for (int64_t T : {1, 7, 65, 300}) {
    std::mt19937 g(uint32_t(T) + 23);
    const int64_t rows = T * Hv;
    auto o = randv(size_t(rows * dv), g, -2.f, 2.f);
    auto z = randv(size_t(rows * dv), g, -4.f, 4.f);
    auto w = randv(size_t(dv), g, 0.5f, 1.5f);
    std::vector<float> want(o.size());
    cpu::gated_rmsnorm(o.data(), z.data(), w.data(), rows, dv, kEps, want.data());
    auto d_o = to_dev(o), dz = to_dev(z), dw = to_dev(w);
    auto dy = poisoned(want.size());
    auto dy16 = poisoned16(want.size());
    PrefillGatedNormArgs a;
    a.rows = rows;
    a.n = dv;
    a.o = d_o->as<float>();
    a.z = dz->as<float>();
    a.w = dw->as<float>();
    a.eps = kEps;
    a.y = dy->as<float>();
    a.y16 = dy16->as<uint16_t>();
    prefill_gated_norm(a, nullptr);
    const std::string what = fmt::format("prefill_gated_norm T={}", T);
    expect_close(to_host<float>(*dy, want.size()), want, 1e-6f, 1e-5f, what + " fp32");
    expect_bf16_of(from_bf16(to_host<uint16_t>(*dy16, want.size())), want, 1e-6f, what + " bf16");
    // z as a column block of a wider row (the prompt's in_proj output: q|k|v, z, b, a), NaN around.
    const int64_t ldz = Hv * dv + 72, z0 = 8;
    std::vector<float> zw(size_t(T * ldz), std::numeric_limits<float>::quiet_NaN());
    for (int64_t t = 0; t < T; ++t)
      std::copy_n(z.begin() + t * Hv * dv, Hv * dv, zw.begin() + t * ldz + z0);
    auto dzw = to_dev(zw);
    auto dy2 = poisoned(want.size());
    a.z = dzw->as<float>() + z0;
    a.z_heads = Hv;
    a.ldz = ldz;
    a.y = dy2->as<float>();
    a.y16 = nullptr;
    prefill_gated_norm(a, nullptr);
    expect_close(to_host<float>(*dy2, want.size()), want, 1e-6f, 1e-5f, what + " strided z");
    // The Pipe kernel's split of y written by the norm (out_proj's A: [T, Hv dv]): the planes of
    // prefill_pipe_split over the fp32 y bit for bit, the 64-group sums to fp32 rounding; then the
    // hi plane alone (Dq).
    const size_t ne = want.size();
    auto shi = poisoned16(ne), slo = poisoned16(ne), ssum = poisoned(ne / 64);
    PipeSplitArgs sp;
    sp.A = dy->as<float>();
    sp.rows = T;
    sp.K = Hv * dv;
    sp.lda = Hv * dv;
    sp.hi = shi->as<uint16_t>();
    sp.lo = slo->as<uint16_t>();
    sp.sum = ssum->as<float>();
    prefill_pipe_split(sp, nullptr);
    auto ghi = poisoned16(ne), glo = poisoned16(ne), gsum = poisoned(ne / 64), ghi2 = poisoned16(ne);
    a.y = nullptr;
    a.hi = ghi->as<uint16_t>();
    a.lo = glo->as<uint16_t>();
    a.sum = gsum->as<float>();
    prefill_gated_norm(a, nullptr);
    const auto want_hi = to_host<uint16_t>(*shi, ne);
    EXPECT_EQ(to_host<uint16_t>(*ghi, ne), want_hi) << what << ": split hi plane";
    EXPECT_EQ(to_host<uint16_t>(*glo, ne), to_host<uint16_t>(*slo, ne)) << what << ": split lo plane";
    expect_close(to_host<float>(*gsum, ne / 64), to_host<float>(*ssum, ne / 64), 1e-5f, 1e-6f,
                 what + " split sums");
    a.hi = ghi2->as<uint16_t>();
    a.lo = nullptr;
    a.sum = nullptr;
    prefill_gated_norm(a, nullptr);
    EXPECT_EQ(to_host<uint16_t>(*ghi2, ne), want_hi) << what << ": split hi plane alone";
  }
}

TEST(PrefillOps, EmbedGatherIsExact) {
  REQUIRE_GPU();
  const int64_t V = 1000, H = 2048;
  for (WFormat f : {WFormat::BF16, WFormat::Q4, WFormat::Q8}) {
    std::mt19937 g(7);
    auto E = make_mat(f, V, H, g, 1.0f);
    std::vector<int32_t> tok = {0, int32_t(V - 1), 5, 5, 999, 17, 512};
    for (int i = 0; i < 60; ++i) tok.push_back(int32_t(g() % V));
    const int64_t T = int64_t(tok.size());
    std::vector<float> want(size_t(T * H));
    for (int64_t t = 0; t < T; ++t) E->m.row_f32(tok[size_t(t)], want.data() + t * H);
    auto dE = to_dev(E->m);
    auto dt = to_dev(tok);
    auto dx = poisoned(want.size());
    PrefillEmbedArgs a;
    a.T = T;
    a.tokens = dt->as<int32_t>();
    a.embed = dE->d;
    a.x = dx->as<float>();
    prefill_embed(a, nullptr);
    expect_close(to_host<float>(*dx, want.size()), want, 0.f, 0.f,
                 fmt::format("prefill_embed {}", wformat_name(f)));
  }
}

TEST(PrefillOps, SeqEndSetsDecodeCounters) {
  REQUIRE_GPU();
  std::vector<int32_t> hist = {4, 8, 15, 16, 23, 42, -1, -1};
  auto dh = to_dev(hist);
  auto dc = to_dev(std::vector<int32_t>{-7, -7, -7});  // len, pos, token
  PrefillSeqEndArgs a;
  a.len = 6;
  a.history = dh->as<int32_t>();
  a.len_out = dc->as<int>();
  a.pos = dc->as<int>() + 1;
  a.token = dc->as<int32_t>() + 2;
  prefill_seq_end(a, nullptr);
  const auto c = to_host<int32_t>(*dc, 3);
  EXPECT_EQ(c[0], 6);
  EXPECT_EQ(c[1], 5);
  EXPECT_EQ(c[2], 42);
  a.len = 0;
  EXPECT_THROW(prefill_seq_end(a, nullptr), Error);
}

// Indices of the k largest values (descending, lower index first on ties), as the CPU router.
std::vector<int> topk_of(const float* v, int n, int k) {
  std::vector<int> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] > v[b]; });
  idx.resize(size_t(k));
  return idx;
}

void run_gemm_f32(F32GemmRoute route, WFormat f, int64_t M, int64_t N, int64_t K, uint32_t seed) {
  std::mt19937 g(seed);
  auto W = make_mat(f, N, K, g, 0.1f);
  auto x = randv(size_t(M * K), g, -2.f, 2.f);
  std::vector<float> want(size_t(M * N));
  cpu::matmul(W->m, x.data(), M, want.data());
  auto dW = to_dev(W->m);
  auto dx = to_dev(x);
  auto dy = poisoned(want.size());
  PrefillGemmF32Args a;
  a.route = route;
  a.M = M;
  a.N = N;
  a.K = K;
  a.A = dx->as<float>();
  a.lda = K;
  a.W = dW->d;
  a.C = dy->as<float>();
  a.ldc = N;
  prefill_gemm_f32(a, nullptr);
  const auto got = to_host<float>(*dy, want.size());
  float amax = 0;
  for (float v : want) amax = std::max(amax, std::fabs(v));
  const std::string what = fmt::format("prefill_gemm_f32 ({}) {} M={} N={} K={}", f32gemm_route_name(route),
                                       wformat_name(f), M, N, K);
  expect_close(got, want, 1e-5f * amax, 1e-5f, what);
  // Discrete choices: the top-8 of each row (router) agree wherever the CPU's 8th and 9th values
  // are further apart than 1e-5 of the row's scale.
  const int k = int(std::min<int64_t>(8, N - 1));
  int compared = 0;
  for (int64_t m = 0; m < M; ++m) {
    const float* wr = want.data() + m * N;
    const auto wk = topk_of(wr, int(N), k + 1);
    if (wr[wk[size_t(k - 1)]] - wr[wk[size_t(k)]] <= 1e-5f * amax) continue;
    auto wsel = std::vector<int>(wk.begin(), wk.begin() + k);
    auto gsel = topk_of(got.data() + m * N, int(N), k);
    std::sort(wsel.begin(), wsel.end());
    std::sort(gsel.begin(), gsel.end());
    EXPECT_EQ(gsel, wsel) << what << ": row " << m << " top-" << k << " differs";
    ++compared;
  }
  EXPECT_GE(compared, int(M * 9 / 10)) << what << ": too many near-ties to compare";
}

TEST(PrefillOps, GemmF32MatchesCpu) {
  REQUIRE_GPU();
  for (F32GemmRoute r : {F32GemmRoute::Tc, F32GemmRoute::Fma}) {
    uint32_t seed = 100;
    for (WFormat f : {WFormat::BF16, WFormat::Q8, WFormat::Q4}) {
      run_gemm_f32(r, f, 1, 4100, 2048, ++seed);   // one row, N not a multiple of 64
      run_gemm_f32(r, f, 7, 256, 2048, ++seed);    // router
      run_gemm_f32(r, f, 65, 256, 2048, ++seed);
      run_gemm_f32(r, f, 300, 16, 2048, ++seed);   // the test models' 16 experts
      run_gemm_f32(r, f, 1000, 256, 2048, ++seed);  // several 128-row tiles, a partial last one
      run_gemm_f32(r, f, 129, 100, 192, ++seed);    // short K (3 groups of 64), N of two partial tiles
    }
  }
  EXPECT_EQ(prefill_router_route(), F32GemmRoute::Tc);  // the prompt step's default
  {
    const ScopedEnv e("KESTREL_ROUTER_GEMM", "fma");
    EXPECT_EQ(prefill_router_route(), F32GemmRoute::Fma);
  }
  {
    const ScopedEnv e("KESTREL_ROUTER_GEMM", "bogus");
    EXPECT_THROW(prefill_router_route(), Error);
  }
}

TEST(PrefillOps, RejectBadArguments) {
  REQUIRE_GPU();
  std::mt19937 g(1);
  auto W = make_mat(WFormat::Q4, 64, 2048, g);
  auto dW = to_dev(W->m);
  auto dx = poisoned(4096);
  auto dy = poisoned(4096);
  PrefillGemmF32Args a;
  a.M = 1;
  a.N = 64;
  a.K = 2048;
  a.A = dx->as<float>();
  a.lda = 2048;
  a.W = dW->d;
  a.C = dy->as<float>();
  a.ldc = 64;
  prefill_gemm_f32(a, nullptr);  // valid
  PrefillGemmF32Args b = a;
  b.K = 2000;
  EXPECT_THROW(prefill_gemm_f32(b, nullptr), Error);  // K % 32, and W.cols != K
  b = a;
  b.N = 65;
  EXPECT_THROW(prefill_gemm_f32(b, nullptr), Error);  // more rows than W has
  b = a;
  b.C = nullptr;
  EXPECT_THROW(prefill_gemm_f32(b, nullptr), Error);
  PrefillRmsNormArgs r;
  r.T = 1;
  r.n = 2046;
  r.x = dx->as<float>();
  r.ldx = 2048;
  r.w = dx->as<float>();
  r.y = dy->as<float>();
  r.ldy = 2048;
  EXPECT_THROW(prefill_rmsnorm(r, nullptr), Error);  // n % 4
  r.n = 2048;
  r.y = nullptr;
  EXPECT_THROW(prefill_rmsnorm(r, nullptr), Error);  // no output
  PrefillGatedNormArgs gn;
  gn.rows = 1;
  gn.n = 128;
  gn.o = dx->as<float>();
  gn.z = dx->as<float>();
  gn.w = nullptr;
  gn.y = dy->as<float>();
  EXPECT_THROW(prefill_gated_norm(gn, nullptr), Error);
  gn.w = dx->as<float>();
  gn.z_heads = 32;
  gn.ldz = 32 * 128 - 4;
  EXPECT_THROW(prefill_gated_norm(gn, nullptr), Error);  // z rows overlap
  gn.z_heads = 0;
  gn.n = 64;
  gn.hi = reinterpret_cast<uint16_t*>(dy->as<float>());
  EXPECT_THROW(prefill_gated_norm(gn, nullptr), Error);  // split planes need n % 128 == 0
  KCUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace kestrel::cuda::test
