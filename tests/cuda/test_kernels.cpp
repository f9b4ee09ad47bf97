// Each CUDA kernel family against the CPU oracle (src/cpu/ops.h) on fresh random inputs at the
// model's real shapes, with outputs poisoned (NaN) before every run.
#include "cpu/ops.h"
#include "util.h"

#include <algorithm>
#include <map>
#include <numeric>

namespace kestrel::cuda::test {
namespace {

constexpr float kEps = 1e-6f;

struct GemvCase {
  WFormat f;
  int64_t K, N;
  int M;
  Prologue pro;
};

void run_gemv(const GemvCase& c, uint32_t seed) {
  std::mt19937 g(seed);
  auto W = make_mat(c.f, c.N, c.K, g);
  auto x = randv(size_t(c.M * c.K), g, -2.f, 2.f);
  auto nw = randv(size_t(c.K), g, 0.5f, 1.5f);
  std::vector<float> xn = x;
  if (c.pro == Prologue::RmsNorm) cpu::rmsnorm(x.data(), nw.data(), c.M, c.K, kEps, xn.data());
  std::vector<float> want(size_t(c.M * c.N));
  cpu::matmul(W->m, xn.data(), c.M, want.data());

  auto dW = to_dev(W->m);
  auto dx = to_dev(x);
  auto dn = to_dev(nw);
  auto dy = poisoned(size_t(c.M * c.N));
  auto dxo = poisoned(size_t(c.M * c.K));
  GemvArgs a;
  a.M = c.M;
  a.K = c.K;
  a.x = dx->as<float>();
  a.ldx = c.K;
  a.pro = c.pro;
  a.norm_w = dn->as<float>();
  a.eps = kEps;
  a.x_out = dxo->as<float>();
  a.seg[0] = GemvSeg{dW->d, Epilogue::Store, dy->as<float>(), c.N, nullptr, nullptr, nullptr};
  a.nseg = 1;
  gemv(a, nullptr);
  const auto got = to_host<float>(*dy, want.size());
  const std::string what = fmt::format("gemv {} K={} N={} M={} pro={}", wformat_name(c.f), c.K, c.N,
                                       c.M, int(c.pro));
  EXPECT_LT(rel_err(got, want, what.c_str()), 2e-5) << what;
  expect_close(got, want, 1e-4f, 1e-3f, what);
  expect_close(to_host<float>(*dxo, xn.size()), xn, 1e-6f, 1e-5f, what + " x_out");
}

// Runs the body once per GEMV route (v1 one row per warp, with lm_head and the large K = 2048
// launches on the streamed kernel of v5 where all-q4 and 16-byte aligned, else on the tensor
// cores; v2 rows in flight; v3 tensor cores; v5 weights streamed by bulk
// copies, at 1 and 2 blocks per SM; M = 1 takes v2/v3/v5 when selected), restoring v1.
struct GemvRoutes {
  template <class F>
  static void each(F&& f) {
    for (int v : {1, 2, 3, 5, 6}) {
      set_gemv_version(v == 6 ? 5 : v);
      set_gemv_stream_blocks_per_sm(v == 6 ? 2 : 1);
      SCOPED_TRACE("gemv route v" + std::to_string(v == 6 ? 5 : v) + (v == 6 ? " (2 blocks per SM)" : ""));
      f();
    }
    set_gemv_version(1);
    set_gemv_stream_blocks_per_sm(1);
  }
};

TEST(CudaGemv, MatchesCpuAllFormatsAndRowCounts) {
  REQUIRE_GPU();
  GemvRoutes::each([] {
  uint32_t seed = 1;
  for (WFormat f : {WFormat::BF16, WFormat::Q4, WFormat::Q8})
    for (int64_t K : {2048, 4096})
      for (int M : {1, 2, 5, 8})
        for (Prologue p : {Prologue::None, Prologue::RmsNorm}) run_gemv({f, K, 1031, M, p}, seed++);
  run_gemv({WFormat::BF16, 512, 2048, 1, Prologue::None}, seed++);
  run_gemv({WFormat::BF16, 512, 777, 3, Prologue::RmsNorm}, seed++);
  run_gemv({WFormat::Q4, 2048, 12352, 1, Prologue::RmsNorm}, seed++);  // GDN in_proj rows
  run_gemv({WFormat::Q8, 2048, 257, 1, Prologue::RmsNorm}, seed++);    // router + 1
  run_gemv({WFormat::Q8, 4096, 300, 1, Prologue::None}, seed++);
  run_gemv({WFormat::Q4, 4096, 2048, 1, Prologue::None}, seed++);      // out_proj / o_proj
  run_gemv({WFormat::BF16, 4096, 2049, 1, Prologue::None}, seed++);
  });
}

TEST(CudaGemv, RejectsBadShapes) {
  REQUIRE_GPU();
  std::mt19937 g(3);
  auto W = make_mat(WFormat::Q4, 64, 512, g);
  auto dW = to_dev(W->m);
  auto dy = poisoned(64);
  auto dx = poisoned(512 * 9);
  GemvArgs a;
  a.M = 1;
  a.K = 512;  // Q4 rows of 512 are too narrow for the 32-lane GEMV
  a.x = dx->as<float>();
  a.ldx = 512;
  a.seg[0] = GemvSeg{dW->d, Epilogue::Store, dy->as<float>(), 64, nullptr, nullptr, nullptr};
  a.nseg = 1;
  EXPECT_THROW(gemv(a, nullptr), Error);
  a.K = 1000;
  EXPECT_THROW(gemv(a, nullptr), Error);
  a.K = 512;
  a.M = 9;
  EXPECT_THROW(gemv(a, nullptr), Error);
}

// GDN-style fused launch: qkv (Q4, conv epilogue over M tokens with a nonzero history), z (Q4),
// b (BF16), a (Q8); then the gated-norm prologue with a residual epilogue.
TEST(CudaGemv, FusedSegmentsConvResidualGatedNorm) {
  REQUIRE_GPU();
  GemvRoutes::each([] {
  // b and a as bf16 / q8 (mixed formats), and all four in q4 (a q4 checkpoint's in_proj: what
  // the all-q4 routes 3 and 5 take, tiled per segment).
  for (bool allq4 : {false, true})
  for (int M : {1, 3, 8}) {
    if (allq4 && M != 1) continue;
    SCOPED_TRACE(allq4 ? "all q4" : "mixed formats");
    std::mt19937 g(100 + M);
    const int64_t K = 2048, C = 8192, Z = 4096, B = 32;
    auto Wqkv = make_mat(WFormat::Q4, C, K, g), Wz = make_mat(WFormat::Q4, Z, K, g),
         Wb = make_mat(allq4 ? WFormat::Q4 : WFormat::BF16, B, K, g),
         Wa = make_mat(allq4 ? WFormat::Q4 : WFormat::Q8, B, K, g);
    auto x = randv(size_t(M * K), g, -2.f, 2.f);
    auto conv_w = randv(size_t(C * 4), g, -0.5f, 0.5f);
    auto state = randv(size_t(C * 3), g, -1.f, 1.f);
    std::vector<float> qkv(size_t(M * C)), z(size_t(M * Z)), b(size_t(M * B)), aa(size_t(M * B));
    cpu::matmul(Wqkv->m, x.data(), M, qkv.data());
    cpu::matmul(Wz->m, x.data(), M, z.data());
    cpu::matmul(Wb->m, x.data(), M, b.data());
    cpu::matmul(Wa->m, x.data(), M, aa.data());
    std::vector<float> st = state, u(size_t(M * C));
    cpu::conv1d_silu(qkv.data(), M, C, 4, conv_w.data(), st.data(), u.data());

    auto d1 = to_dev(Wqkv->m), d2 = to_dev(Wz->m), d3 = to_dev(Wb->m), d4 = to_dev(Wa->m);
    auto dx = to_dev(x), dcw = to_dev(conv_w), dst = to_dev(state);
    auto du = poisoned(size_t(M * C)), dz = poisoned(size_t(M * Z)), db = poisoned(size_t(M * B)),
         da = poisoned(size_t(M * B));
    GemvArgs a;
    a.M = M;
    a.K = K;
    a.x = dx->as<float>();
    a.ldx = K;
    a.seg[0] = GemvSeg{d1->d, Epilogue::ConvSilu, du->as<float>(), C, dst->as<float>(), dcw->as<float>(), nullptr};
    a.seg[1] = GemvSeg{d2->d, Epilogue::Store, dz->as<float>(), Z, nullptr, nullptr, nullptr};
    a.seg[2] = GemvSeg{d3->d, Epilogue::Store, db->as<float>(), B, nullptr, nullptr, nullptr};
    a.seg[3] = GemvSeg{d4->d, Epilogue::Store, da->as<float>(), B, nullptr, nullptr, nullptr};
    a.nseg = 4;
    gemv(a, nullptr);
    const std::string w = fmt::format("fused M={}", M);
    EXPECT_LT(rel_err(to_host<float>(*du, u.size()), u, (w + " u").c_str()), 2e-5);
    EXPECT_LT(rel_err(to_host<float>(*dst, st.size()), st, (w + " conv state").c_str()), 2e-5);
    EXPECT_LT(rel_err(to_host<float>(*dz, z.size()), z, (w + " z").c_str()), 2e-5);
    EXPECT_LT(rel_err(to_host<float>(*db, b.size()), b, (w + " b").c_str()), 2e-5);
    EXPECT_LT(rel_err(to_host<float>(*da, aa.size()), aa, (w + " a").c_str()), 2e-5);

    // out_proj: y += W (gated_rmsnorm(o, z)).
    auto Wo = make_mat(WFormat::Q4, K, Z, g);
    auto o = randv(size_t(M * Z), g, -1.f, 1.f);
    auto gw = randv(128, g, 0.5f, 1.5f);
    auto resid = randv(size_t(M * K), g, -1.f, 1.f);
    std::vector<float> yn(size_t(M * Z)), want = resid, tmp(size_t(M * K));
    cpu::gated_rmsnorm(o.data(), z.data(), gw.data(), M * 32, 128, kEps, yn.data());
    cpu::matmul(Wo->m, yn.data(), M, tmp.data());
    for (size_t i = 0; i < want.size(); ++i) want[i] += tmp[i];
    auto dWo = to_dev(Wo->m);
    auto dO = to_dev(o), dZ = to_dev(z), dgw = to_dev(gw), dr = to_dev(resid);
    GemvArgs go;
    go.M = M;
    go.K = Z;
    go.x = dO->as<float>();
    go.ldx = Z;
    go.pro = Prologue::GatedRmsNorm;
    go.norm_w = dgw->as<float>();
    go.eps = kEps;
    go.z = dZ->as<float>();
    go.ldz = Z;
    go.norm_group = 128;
    go.seg[0] = GemvSeg{dWo->d, Epilogue::Residual, dr->as<float>(), K, nullptr, nullptr, nullptr};
    go.nseg = 1;
    gemv(go, nullptr);
    EXPECT_LT(rel_err(to_host<float>(*dr, want.size()), want, (w + " out_proj").c_str()), 2e-5);
  }
  });
}

// lm_head at the real vocabulary (+3, odd) with the fused argmax.
TEST(CudaGemv, LogitsArgmaxAtRealVocab) {
  REQUIRE_GPU();
  GemvRoutes::each([] {
  for (int M : {1, 2}) {
    std::mt19937 g(7 + M);
    const int64_t K = 2048, N = 248323;
    auto W = make_mat(WFormat::Q4, N, K, g);
    auto x = randv(size_t(M * K), g, -1.f, 1.f);
    std::vector<float> want(size_t(M * N));
    cpu::matmul(W->m, x.data(), M, want.data());
    auto dW = to_dev(W->m);
    auto dx = to_dev(x);
    auto dy = poisoned(size_t(M * N));
    DevBuf key(8 * size_t(M));
    KCUDA(cudaMemset(key.p, 0, 8 * size_t(M)));
    GemvArgs a;
    a.M = M;
    a.K = K;
    a.x = dx->as<float>();
    a.ldx = K;
    a.seg[0] = GemvSeg{dW->d, Epilogue::Logits, dy->as<float>(), N, nullptr, nullptr,
                       key.as<unsigned long long>()};
    a.nseg = 1;
    gemv(a, nullptr);
    const auto got = to_host<float>(*dy, want.size());
    EXPECT_LT(rel_err(got, want, "logits"), 2e-5);
    const auto keys = to_host<unsigned long long>(key, size_t(M));
    for (int m = 0; m < M; ++m) {
      const auto* row = got.data() + size_t(m) * N;
      const int64_t best = std::max_element(row, row + N) - row;  // first maximum
      EXPECT_EQ(unpack_argmax_host(keys[size_t(m)]), best) << "row " << m;
    }
  }
  });
}

// ---------------------------------------------------------------- GDN
struct GdnRef {
  std::vector<float> o, S;  // S in the CPU layout [Hv, dk, dv]
};
GdnRef gdn_cpu(int T, const std::vector<float>& u, const std::vector<float>& b,
               const std::vector<float>& a, const std::vector<float>& A_log,
               const std::vector<float>& dtb, std::vector<float> S) {
  const int Hk = 16, Hv = 32, dk = 128, dv = 128, C = 8192;
  std::vector<float> q(size_t(T * Hk * dk)), k(q.size()), v(size_t(T * Hv * dv)), beta(size_t(T * Hv)),
      g(size_t(T * Hv));
  for (int t = 0; t < T; ++t) {
    std::copy(u.begin() + t * C, u.begin() + t * C + 2048, q.begin() + t * 2048);
    std::copy(u.begin() + t * C + 2048, u.begin() + t * C + 4096, k.begin() + t * 2048);
    std::copy(u.begin() + t * C + 4096, u.begin() + (t + 1) * C, v.begin() + t * 4096);
    for (int j = 0; j < Hv; ++j) {
      beta[size_t(t * Hv + j)] = cpu::sigmoid(b[size_t(t * Hv + j)]);
      g[size_t(t * Hv + j)] = -std::exp(A_log[size_t(j)]) * cpu::softplus(a[size_t(t * Hv + j)] + dtb[size_t(j)]);
    }
  }
  cpu::l2norm_rows(q.data(), T * Hk, dk, 1e-6f, 1.f / std::sqrt(128.f));
  cpu::l2norm_rows(k.data(), T * Hk, dk, 1e-6f, 1.f);
  GdnRef r;
  r.o.resize(size_t(T * Hv * dv));
  cpu::gdn_recurrent({Hk, Hv, dk, dv}, T, q.data(), k.data(), v.data(), beta.data(), g.data(), S.data(),
                     r.o.data());
  r.S = std::move(S);
  return r;
}
std::vector<float> transpose_state(const std::vector<float>& S) {  // [Hv, a, b] -> [Hv, b, a]
  std::vector<float> t(S.size());
  for (int j = 0; j < 32; ++j)
    for (int r = 0; r < 128; ++r)
      for (int i = 0; i < 128; ++i) t[size_t((j * 128 + i) * 128 + r)] = S[size_t((j * 128 + r) * 128 + i)];
  return t;
}

TEST(CudaGdn, DecodeMatchesRecurrenceWithNonzeroState) {
  REQUIRE_GPU();
  for (int T : {1, 3, 8}) {
    std::mt19937 g(200 + T);
    auto u = randv(size_t(T * 8192), g, -1.f, 1.f);
    auto b = randv(size_t(T * 32), g, -3.f, 3.f), a = randv(size_t(T * 32), g, -3.f, 3.f);
    auto A_log = randv(32, g, 0.f, 2.7f), dtb = randv(32, g, -1.f, 1.f);
    auto S = randv(size_t(32 * 128 * 128), g, -0.3f, 0.3f);
    const GdnRef ref = gdn_cpu(T, u, b, a, A_log, dtb, S);
    auto du = to_dev(u), db = to_dev(b), da = to_dev(a), dA = to_dev(A_log), dd = to_dev(dtb);
    auto dS = to_dev(transpose_state(S));
    auto dO = poisoned(ref.o.size());
    GdnDecodeArgs ga;
    ga.T = T;
    ga.u = du->as<float>();
    ga.ldu = 8192;
    ga.b = db->as<float>();
    ga.a = da->as<float>();
    ga.ldb = ga.lda = 32;
    ga.A_log = dA->as<float>();
    ga.dt_bias = dd->as<float>();
    ga.state = dS->as<float>();
    ga.o = dO->as<float>();
    ga.Hk = 16;
    ga.Hv = 32;
    ga.dk = ga.dv = 128;
    gdn_decode(ga, nullptr);
    EXPECT_LT(rel_err(to_host<float>(*dO, ref.o.size()), ref.o, "gdn o"), 1e-5) << "T=" << T;
    EXPECT_LT(rel_err(transpose_state(to_host<float>(*dS, S.size())), ref.S, "gdn state"), 1e-5)
        << "T=" << T;
  }
}

TEST(CudaGdn, SixtyFourStepsBoundedDrift) {
  REQUIRE_GPU();
  std::mt19937 g(300);
  auto A_log = randv(32, g, 0.f, 2.7f), dtb = randv(32, g, -1.f, 1.f);
  std::vector<float> S(size_t(32 * 128 * 128), 0.f);
  auto dA = to_dev(A_log), dd = to_dev(dtb);
  auto dS = to_dev(transpose_state(S));
  double worst = 0;
  for (int step = 0; step < 64; ++step) {
    auto u = randv(8192, g, -1.f, 1.f);
    auto b = randv(32, g, -3.f, 3.f), a = randv(32, g, -3.f, 3.f);
    const GdnRef ref = gdn_cpu(1, u, b, a, A_log, dtb, S);
    S = ref.S;
    auto du = to_dev(u), db = to_dev(b), da = to_dev(a);
    auto dO = poisoned(4096);
    GdnDecodeArgs ga;
    ga.u = du->as<float>();
    ga.ldu = 8192;
    ga.b = db->as<float>();
    ga.a = da->as<float>();
    ga.ldb = ga.lda = 32;
    ga.A_log = dA->as<float>();
    ga.dt_bias = dd->as<float>();
    ga.state = dS->as<float>();
    ga.o = dO->as<float>();
    ga.Hk = 16;
    ga.Hv = 32;
    ga.dk = ga.dv = 128;
    gdn_decode(ga, nullptr);
    worst = std::max(worst, rel_err(to_host<float>(*dO, 4096), ref.o, "gdn o step"));
  }
  EXPECT_LT(worst, 1e-4) << "worst output error over 64 steps";
  EXPECT_LT(rel_err(transpose_state(to_host<float>(*dS, S.size())), S, "state after 64"), 1e-4);
}

// ---------------------------------------------------------------- attention
void run_attention(int64_t capacity, int pos, uint32_t seed) {
  std::mt19937 g(seed);
  const int H = 16, KVH = 2, D = 256;
  const double theta = 1e7;
  std::vector<uint16_t> kc(size_t(capacity * KVH * D), 0), vc(kc.size(), 0);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (size_t i = 0; i < size_t(pos) * KVH * D; ++i) {
    kc[i] = f32_to_bf16(nd(g));
    vc[i] = f32_to_bf16(nd(g));
  }
  auto qg = randv(size_t(H * 2 * D), g, -2.f, 2.f);
  auto k = randv(size_t(KVH * D), g, -2.f, 2.f), v = randv(size_t(KVH * D), g, -2.f, 2.f);
  auto qn = randv(D, g, 0.5f, 1.5f), kn = randv(D, g, 0.5f, 1.5f);
  // CPU reference.
  std::vector<float> q(size_t(H * D)), gate(size_t(H * D)), kk = k;
  for (int h = 0; h < H; ++h)
    for (int d = 0; d < D; ++d) {
      q[size_t(h * D + d)] = qg[size_t(h * 2 * D + d)];
      gate[size_t(h * D + d)] = qg[size_t(h * 2 * D + D + d)];
    }
  cpu::rmsnorm(q.data(), qn.data(), H, D, kEps, q.data());
  cpu::rmsnorm(kk.data(), kn.data(), KVH, D, kEps, kk.data());
  cpu::rope_neox(q.data(), 1, H, D, 64, pos, theta);
  cpu::rope_neox(kk.data(), 1, KVH, D, 64, pos, theta);
  std::vector<float> kf(size_t((pos + 1) * KVH * D)), vf(kf.size());
  for (size_t i = 0; i < size_t(pos) * KVH * D; ++i) {
    kf[i] = bf16_to_f32(kc[i]);
    vf[i] = bf16_to_f32(vc[i]);
  }
  for (int i = 0; i < KVH * D; ++i) {
    kf[size_t(pos) * KVH * D + size_t(i)] = round_bf16(kk[size_t(i)]);
    vf[size_t(pos) * KVH * D + size_t(i)] = round_bf16(v[size_t(i)]);
  }
  std::vector<float> want(size_t(H * D));
  cpu::attention(q.data(), 1, pos, kf.data(), vf.data(), H, KVH, D, want.data());
  for (size_t i = 0; i < want.size(); ++i) want[i] *= cpu::sigmoid(gate[i]);

  auto dkc = to_dev(kc), dvc = to_dev(vc), dqg = to_dev(qg), dk = to_dev(k), dv = to_dev(v),
       dqn = to_dev(qn), dkn = to_dev(kn);
  auto dpos = to_dev(std::vector<int>{pos});
  const int nsplit = attn_nsplit(capacity);
  auto part = poisoned(size_t(H) * nsplit * (D + 2));
  auto dout = poisoned(size_t(H * D));
  AttnDecodeArgs a;
  a.qg = dqg->as<float>();
  a.k = dk->as<float>();
  a.v = dv->as<float>();
  a.q_norm = dqn->as<float>();
  a.k_norm = dkn->as<float>();
  a.eps = kEps;
  a.pos = dpos->as<int>();
  a.capacity = capacity;
  a.kcache = dkc->as<uint16_t>();
  a.vcache = dvc->as<uint16_t>();
  a.rope_theta = theta;
  a.heads = H;
  a.kv_heads = KVH;
  a.head_dim = D;
  a.rotary_dim = 64;
  a.nsplit = nsplit;
  a.partial = part->as<float>();
  a.out = dout->as<float>();
  attn_decode(a, nullptr);
  const std::string w = fmt::format("attention capacity {} pos {} nsplit {}", capacity, pos, nsplit);
  EXPECT_LT(rel_err(to_host<float>(*dout, want.size()), want, w.c_str()), 1e-4) << w;
  const auto kc2 = to_host<uint16_t>(*dkc, kc.size());
  std::vector<float> knew(size_t(KVH * D)), kwant(knew.size());
  for (int i = 0; i < KVH * D; ++i) {
    knew[size_t(i)] = bf16_to_f32(kc2[size_t(pos) * KVH * D + size_t(i)]);
    kwant[size_t(i)] = kf[size_t(pos) * KVH * D + size_t(i)];
  }
  // The cached k is bf16: equal to the reference up to one bf16 rounding step.
  expect_close(knew, kwant, 1e-3f, 1e-2f, w + " cached k");
}

TEST(CudaAttention, DecodeMatchesCpuAcrossSplitThresholds) {
  REQUIRE_GPU();
  uint32_t seed = 400;
  run_attention(64, 0, seed++);     // nsplit 1, first token
  run_attention(64, 50, seed++);
  for (int pos : {1, 31, 32, 33, 63, 64, 65, 4095, 4096, 4100, 8191})  // nsplit 128: chunk 32 -> 64
    run_attention(8192, pos, seed++);
  run_attention(40000, 32767, seed++);  // nsplit 512, chunk 64
  run_attention(40000, 32768, seed++);  // chunk 96
  run_attention(131072, 100000, seed++);
  run_attention(131072, 131071, seed++);  // the last position: chunk 256, the new row last
}

// ---------------------------------------------------------------- MoE
struct MoeCase {
  int E, topk;
  WFormat f, fr;  // experts / router format
  bool fused = false;  // moe_experts (one launch) instead of moe_gate_up + moe_down
  RoutePlace place = RoutePlace::Tail;  // where the routing runs
  RouteAlgo algo = RouteAlgo::Warp;
  bool mma = false;  // q4 experts on the tensor cores (moe_gate_up_mma_kernel, moe_down_mma_kernel)
  // moe_down_mma's selection read: 0 after its wait, 1 before it (SelRead::Flag when gate/up
  // routes, else Early), 2 as 1 with gate/up triggering after its routing (moe_down_early).
  int early = 0;
  int depth = 1;  // tiles in flight per tensor-core gate/up block (moe_gate_up_depth)
};

struct MoeExpertSet {
  std::unique_ptr<HostMat> gate, up, down;
  std::unique_ptr<DevMat> dG, dU, dD;
};

std::map<std::pair<int, int>, MoeExpertSet>& moe_expert_sets() {  // cleared by the tests that fill it
  static std::map<std::pair<int, int>, MoeExpertSet> sets;
  return sets;
}

const MoeExpertSet& moe_expert_set(int E, WFormat f, int64_t H, int64_t I) {
  MoeExpertSet& s = moe_expert_sets()[{E, int(f)}];
  if (!s.gate) {
    std::mt19937 g(7000u + uint32_t(E) * 8u + uint32_t(f));
    s.gate = make_mat(f, E * I, H, g);
    s.up = make_mat(f, E * I, H, g);
    s.down = make_mat(f, E * H, I, g);
    s.dG = to_dev(s.gate->m);
    s.dU = to_dev(s.up->m);
    s.dD = to_dev(s.down->m);
  }
  return s;
}

void run_moe(const MoeCase& c, uint32_t seed) {
  std::mt19937 g(seed);
  const int64_t H = 2048, I = 512, Is = 512;
  ModelConfig cfg;
  cfg.hidden_size = int(H);
  cfg.num_experts = c.E;
  cfg.num_experts_per_tok = c.topk;
  cfg.moe_intermediate_size = int(I);
  cfg.shared_expert_intermediate_size = int(Is);
  auto router = make_mat(c.fr, c.E, H, g, 0.5f);  // wide logits: a clear top-k
  // The experts' weights (805 M values at E = 256) are built once per (E, format) and shared by
  // every case of that kind: building them took most of this test's time. The router, the inputs
  // and the shared expert stay per case, so each case still routes to its own experts.
  const MoeExpertSet& es = moe_expert_set(c.E, c.f, H, I);
  const HostMat* gate = es.gate.get();
  const HostMat* up = es.up.get();
  const HostMat* down = es.down.get();
  auto sgm = make_mat(c.f, Is, H, g), sum = make_mat(c.f, Is, H, g), sdm = make_mat(c.f, H, Is, g);
  auto seg = make_mat(c.fr, 1, H, g);
  MoeWeights w;
  w.router = router->m;
  for (int e = 0; e < c.E; ++e) {
    w.gate.push_back(gate->m.slice_rows(e * I, I));
    w.up.push_back(up->m.slice_rows(e * I, I));
    w.down.push_back(down->m.slice_rows(e * H, H));
  }
  w.shared_gate = sgm->m;
  w.shared_up = sum->m;
  w.shared_down = sdm->m;
  w.shared_expert_gate = seg->m;
  auto x = randv(size_t(H), g, -2.f, 2.f);
  auto nw = randv(size_t(H), g, 0.5f, 1.5f);
  std::vector<float> h(static_cast<size_t>(H)), out(static_cast<size_t>(H));
  cpu::rmsnorm(x.data(), nw.data(), 1, H, kEps, h.data());
  cpu::moe(w, cfg, h.data(), 1, out.data());
  std::vector<float> want = x;
  for (int64_t i = 0; i < H; ++i) want[size_t(i)] += out[size_t(i)];

  const DevMat* dG = es.dG.get();
  const DevMat* dU = es.dU.get();
  const DevMat* dD = es.dD.get();
  auto dR = to_dev(router->m), dSG = to_dev(sgm->m), dSU = to_dev(sum->m), dSD = to_dev(sdm->m), dSE = to_dev(seg->m);
  auto dx = to_dev(x), dnw = to_dev(nw);
  auto dl = poisoned(size_t(c.E)), dsg = poisoned(size_t(Is)), dsu = poisoned(size_t(Is)),
       dse = poisoned(1), dh = poisoned(size_t(H)), dact = poisoned(size_t(c.topk * I));
  DevBuf ti(64), tw(64);
  GemvArgs a;
  a.M = 1;
  a.K = H;
  a.x = dx->as<float>();
  a.ldx = H;
  a.pro = Prologue::RmsNorm;
  a.norm_w = dnw->as<float>();
  a.eps = kEps;
  a.x_out = dh->as<float>();
  a.seg[0] = GemvSeg{dR->d, Epilogue::Store, dl->as<float>(), c.E, nullptr, nullptr, nullptr};
  a.seg[1] = GemvSeg{dSE->d, Epilogue::Store, dse->as<float>(), 1, nullptr, nullptr, nullptr};
  a.seg[2] = GemvSeg{dSG->d, Epilogue::Store, dsg->as<float>(), Is, nullptr, nullptr, nullptr};
  a.seg[3] = GemvSeg{dSU->d, Epilogue::Store, dsu->as<float>(), Is, nullptr, nullptr, nullptr};
  a.nseg = 4;
  DevBuf counter(4);
  KCUDA(cudaMemset(counter.p, 0, 4));
  if (c.place == RoutePlace::Tail)
    a.route = RouteTail{dl->as<float>(), c.E, c.topk, ti.as<int>(), tw.as<float>(), counter.as<unsigned>(), c.algo};
  // Twice, the routing poisoned in between: the last block of each launch routes (the counter
  // is left at zero for the next launch), or the route kernel after it (or moe_gate_up, below).
  for (int rep = 0; rep < 2; ++rep) {
    KCUDA(cudaMemset(ti.p, 0xff, 64));
    KCUDA(cudaMemset(tw.p, 0xff, 64));
    gemv(a, nullptr);
    if (c.place == RoutePlace::Kernel)
      decode_route(DecodeRouteArgs{dl->as<float>(), c.E, c.topk, ti.as<int>(), tw.as<float>(), c.algo}, nullptr);
  }
  EXPECT_EQ(to_host<unsigned>(counter, 1)[0], 0u) << "route counter not reset";
  MoeGateUpArgs gu;
  gu.E = c.E;
  gu.topk = c.topk;
  gu.h = dh->as<float>();
  gu.hidden = H;
  gu.I = I;
  gu.gate = dG->d;
  gu.up = dU->d;
  gu.topk_idx = ti.as<int>();
  gu.act = dact->as<float>();
  if (c.place == RoutePlace::GateUp) {  // moe_gate_up routes; the selection reaches moe_down through ti/tw
    gu.logits = dl->as<float>();
    gu.algo = c.algo;
    gu.route_idx = ti.as<int>();
    gu.route_w = tw.as<float>();
    gu.topk_idx = nullptr;
  }
  MoeDownArgs dn;
  dn.topk = c.topk;
  dn.hidden = H;
  dn.I = I;
  dn.Is = Is;
  dn.topk_idx = ti.as<int>();
  dn.topk_w = tw.as<float>();
  dn.act = dact->as<float>();
  dn.sg = dsg->as<float>();
  dn.su = dsu->as<float>();
  dn.sgate = dse->as<float>();
  dn.down = dD->d;
  dn.shared_down = dSD->d;
  dn.x = dx->as<float>();
  DevBuf flag(8);
  KCUDA(cudaMemset(flag.p, 0, 8));
  if (c.early > 0) {
    if (c.place == RoutePlace::GateUp) {
      dn.sel = SelRead::Flag;
      dn.sel_ready = gu.sel_ready = flag.as<unsigned>();
    } else {
      dn.sel = SelRead::Early;
    }
    gu.trigger_early = c.early >= 2;
  }
  if (c.fused) {
    DevBuf mc(8);
    KCUDA(cudaMemset(mc.p, 0, 8));
    // Twice from the same residual: the second launch must find the counters reset.
    const std::vector<float> x0 = x;
    moe_experts(MoeExpertsArgs{gu, dn, mc.as<unsigned>()}, nullptr);
    KCUDA(cudaMemcpy(dx->p, x0.data(), x0.size() * 4, cudaMemcpyHostToDevice));
    KCUDA(cudaMemset(dact->p, 0xff, size_t(c.topk * I) * 4));  // poison: the second launch recomputes it
    moe_experts(MoeExpertsArgs{gu, dn, mc.as<unsigned>()}, nullptr);
    EXPECT_EQ(to_host<unsigned>(mc, 2), (std::vector<unsigned>{0u, 0u})) << "moe_experts counters not reset";
  } else {
    set_moe_mma_enabled(c.mma);  // read at the launches
    set_moe_gate_up_depth(c.depth);
    moe_gate_up(gu, nullptr);
    moe_down(dn, nullptr);
    set_moe_mma_enabled(true);  // the defaults
    set_moe_gate_up_depth(1);
    EXPECT_EQ(to_host<unsigned>(flag, 2), (std::vector<unsigned>{0u, 0u})) << "selection flag not reset";
  }
  const std::string wh = fmt::format("moe E={} k={} {} router {}{} routing {} {} early {}", c.E, c.topk,
                                     wformat_name(c.f), wformat_name(c.fr),
                                     c.fused ? " fused" : c.mma ? " experts on tensor cores" : "",
                                     route_place_name(c.place), route_algo_name(c.algo), c.early) +
                         (c.depth != 1 ? fmt::format(" gate/up depth {}", c.depth) : std::string());
  std::vector<float> got = to_host<float>(*dx, size_t(H));
  std::vector<float> dgot(static_cast<size_t>(H)), dwant(static_cast<size_t>(H));
  for (int64_t i = 0; i < H; ++i) {
    dgot[size_t(i)] = got[size_t(i)] - x[size_t(i)];
    dwant[size_t(i)] = out[size_t(i)];
  }
  EXPECT_LT(rel_err(dgot, dwant, wh.c_str()), 1e-4) << wh;
  const auto idx = to_host<int>(ti, size_t(c.topk));
  EXPECT_TRUE(std::is_sorted(idx.begin(), idx.end())) << wh << ": experts not in ascending order";
}

// The decode MoE cases, in five tests so that each one's time shows; the expert weight sets they
// share are freed after each (the full-size benchmark tests need the memory).
class CudaMoeDecode : public ::testing::Test {
 protected:
  void TearDown() override { moe_expert_sets().clear(); }
};

TEST_F(CudaMoeDecode, MatchesCpu) {
  REQUIRE_GPU();
  for (bool fused : {false, true}) {
    uint32_t seed = 500;
    run_moe({256, 8, WFormat::Q4, WFormat::Q8, fused}, seed++);
    run_moe({256, 8, WFormat::BF16, WFormat::BF16, fused}, seed++);
    run_moe({16, 4, WFormat::Q8, WFormat::BF16, fused}, seed++);
    run_moe({8, 2, WFormat::Q4, WFormat::Q4, fused}, seed++);
    run_moe({256, 16, WFormat::Q4, WFormat::Q8, fused}, seed++);
  }
}

TEST_F(CudaMoeDecode, RoutingPlaces) {
  REQUIRE_GPU();
  uint32_t seed = 520;
  for (RoutePlace p : {RoutePlace::Tail, RoutePlace::Kernel, RoutePlace::GateUp})
    for (RouteAlgo al : {RouteAlgo::Warp, RouteAlgo::Block}) {
      if (p == RoutePlace::Tail && al == RouteAlgo::Warp) continue;  // MatchesCpu
      run_moe({256, 8, WFormat::Q4, WFormat::Q8, false, p, al}, seed++);
      run_moe({16, 4, WFormat::BF16, WFormat::BF16, false, p, al}, seed++);
      run_moe({8, 2, WFormat::Q4, WFormat::Q4, false, p, al}, seed++);
    }
}

// q4 experts on the tensor cores, with the routing before them and inside gate/up (top-k 16:
// the tensor-core gate/up and the scalar down).
TEST_F(CudaMoeDecode, TensorCoreExperts) {
  REQUIRE_GPU();
  uint32_t seed = 535;
  for (RoutePlace p : {RoutePlace::Kernel, RoutePlace::GateUp}) {
    run_moe({256, 8, WFormat::Q4, WFormat::Q8, false, p, RouteAlgo::Block, true}, seed++);
    run_moe({256, 16, WFormat::Q4, WFormat::Q8, false, p, RouteAlgo::Block, true}, seed++);
    run_moe({8, 2, WFormat::Q4, WFormat::Q4, false, p, RouteAlgo::Warp, true}, seed++);
  }
}

// The tensor-core down kernel reading the selection before its wait (from the tail, the routing
// kernel, or gate/up's block 0 through the flag), with and without gate/up's early trigger.
TEST_F(CudaMoeDecode, EarlySelectionRead) {
  REQUIRE_GPU();
  uint32_t seed = 541;
  for (RoutePlace p : {RoutePlace::Tail, RoutePlace::Kernel, RoutePlace::GateUp})
    for (int early : {1, 2}) {
      run_moe({256, 8, WFormat::Q4, WFormat::Q8, false, p, RouteAlgo::Block, true, early}, seed++);
      run_moe({8, 2, WFormat::Q4, WFormat::Q4, false, p, RouteAlgo::Warp, true, early}, seed++);
    }
}

// Two tiles in flight per gate/up block: top-8 (512 tiles, about 2 per block), top-16 (1,024:
// both register sets reloaded), top-2 of 8 (128: one tile per block, the second set unused).
TEST_F(CudaMoeDecode, GateUpDepth2) {
  REQUIRE_GPU();
  uint32_t seed = 553;
  for (int k : {8, 16, 2})
    run_moe({k == 2 ? 8 : 256, k, WFormat::Q4, k == 2 ? WFormat::Q4 : WFormat::Q8, false, RoutePlace::GateUp,
             RouteAlgo::Block, true, k == 8 ? 2 : 0, 2},
            seed++);
}

TEST(CudaMoe, EarlySelectionNeedsTheTensorCoreDown) {  // launcher checks; nothing runs
  REQUIRE_GPU();
  MoeDownArgs dn;
  dn.topk = 16;  // the scalar kernel
  dn.hidden = 2048;
  dn.I = dn.Is = 512;
  dn.sel = SelRead::Early;
  try {
    moe_down(dn, nullptr);
    ADD_FAILURE() << "moe_down accepted an early selection read without the tensor-core kernel";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("early selection"), std::string::npos) << e.what();
  }
}

TEST(CudaMoe, FusedLaunchRejectsRoutingInGateUp) {
  REQUIRE_GPU();
  MoeExpertsArgs a;
  a.gu.E = 8;
  a.gu.topk = 2;
  a.gu.hidden = 2048;
  float f = 0.f;
  a.gu.logits = &f;
  try {
    moe_experts(a, nullptr);
    ADD_FAILURE() << "moe_experts accepted routing in its gate/up blocks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("routes before it"), std::string::npos) << e.what();
  }
}

TEST(CudaMoe, FusedLaunchRejectsMismatchedParts) {
  REQUIRE_GPU();
  std::mt19937 g(9);
  const int64_t H = 2048, I = 512, E = 8;
  auto gate = make_mat(WFormat::Q4, E * I, H, g), down = make_mat(WFormat::Q4, E * H, I, g),
       down8 = make_mat(WFormat::Q8, E * H, I, g), sdm = make_mat(WFormat::Q4, H, I, g);
  auto dG = to_dev(gate->m), dD = to_dev(down->m), dD8 = to_dev(down8->m), dSD = to_dev(sdm->m);
  auto dh = poisoned(size_t(H)), dact = poisoned(size_t(8 * I)), dsg = poisoned(size_t(I)),
       dsu = poisoned(size_t(I)), dse = poisoned(1), dx = poisoned(size_t(H));
  DevBuf ti(64), tw(64), mc(8);
  MoeExpertsArgs a;
  a.gu.E = E;
  a.gu.topk = 8;
  a.gu.h = dh->as<float>();
  a.gu.hidden = H;
  a.gu.I = I;
  a.gu.gate = a.gu.up = dG->d;
  a.gu.topk_idx = ti.as<int>();
  a.gu.act = dact->as<float>();
  a.dn.topk = 8;
  a.dn.hidden = H;
  a.dn.I = a.dn.Is = I;
  a.dn.topk_idx = ti.as<int>();
  a.dn.topk_w = tw.as<float>();
  a.dn.act = dact->as<float>();
  a.dn.sg = dsg->as<float>();
  a.dn.su = dsu->as<float>();
  a.dn.sgate = dse->as<float>();
  a.dn.down = dD->d;
  a.dn.shared_down = dSD->d;
  a.dn.x = dx->as<float>();
  MoeExpertsArgs b = a;
  EXPECT_THROW(moe_experts(b, nullptr), Error) << "null counters";
  b.counters = mc.as<unsigned>();
  b.dn.act = dsg->as<float>();
  EXPECT_THROW(moe_experts(b, nullptr), Error) << "act differs between the parts";
  b = a;
  b.counters = mc.as<unsigned>();
  b.dn.topk = 4;
  EXPECT_THROW(moe_experts(b, nullptr), Error) << "top-k differs";
  b = a;
  b.counters = mc.as<unsigned>();
  b.dn.down = dD8->d;
  EXPECT_THROW(moe_experts(b, nullptr), Error) << "down format differs from gate/up (and from shared_down)";
}

// The router GEMV's route tail on exact ties: router rows repeat with period 37, so equal logits
// come in groups and the top-k must take the lower expert index first (the CPU oracle's order),
// for expert counts that are and are not multiples of 32.
void run_route(int E, int topk, uint32_t seed, bool kernel, RouteAlgo algo) {
  std::mt19937 g(seed);
  const int64_t H = 2048;
  constexpr int kPeriod = 37;
  auto base = make_mat(WFormat::BF16, kPeriod, H, g, 0.5f);
  HostMat r;
  r.m = base->m;
  r.m.rows = E;
  r.data.resize(size_t(E) * H * 2);
  for (int e = 0; e < E; ++e)
    std::copy_n(base->data.data() + size_t(e % kPeriod) * H * 2, H * 2, r.data.data() + size_t(e) * H * 2);
  r.m.data = r.data.data();
  const auto x = randv(size_t(H), g, -2.f, 2.f);
  auto dR = to_dev(r.m);
  auto dx = to_dev(x);
  auto dl = poisoned(size_t(E));
  DevBuf ti(64), tw(64), counter(4);
  KCUDA(cudaMemset(counter.p, 0, 4));
  KCUDA(cudaMemset(ti.p, 0xff, 64));
  GemvArgs a;
  a.M = 1;
  a.K = H;
  a.x = dx->as<float>();
  a.ldx = H;
  a.seg[0] = GemvSeg{dR->d, Epilogue::Store, dl->as<float>(), E, nullptr, nullptr, nullptr};
  a.nseg = 1;
  if (kernel) {  // the routing as its own launch
    gemv(a, nullptr);
    decode_route(DecodeRouteArgs{dl->as<float>(), E, topk, ti.as<int>(), tw.as<float>(), algo}, nullptr);
  } else {
    a.route = RouteTail{dl->as<float>(), E, topk, ti.as<int>(), tw.as<float>(), counter.as<unsigned>(), algo};
    gemv(a, nullptr);
  }
  const auto l = to_host<float>(*dl, size_t(E));
  std::vector<int> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int u, int v) { return l[size_t(u)] > l[size_t(v)]; });
  std::vector<int> want(order.begin(), order.begin() + topk);
  std::sort(want.begin(), want.end());
  const float mx = l[size_t(order[0])];
  double top = 0;
  for (int e : want) top += std::exp(double(l[size_t(e)]) - mx);
  std::vector<float> wantw;
  for (int e : want) wantw.push_back(float(std::exp(double(l[size_t(e)]) - mx) / top));
  const std::string wh = fmt::format("route ties E={} k={}{} {}", E, topk, kernel ? " (route kernel)" : "",
                                     route_algo_name(algo));
  EXPECT_EQ(to_host<int>(ti, size_t(topk)), want) << wh;
  expect_close(to_host<float>(tw, size_t(topk)), wantw, 1e-6f, 1e-5f, wh + " weights");
}

TEST(CudaMoe, RouteTiesTakeLowerExpert) {
  REQUIRE_GPU();
  GemvRoutes::each([] {
    for (bool kernel : {false, true})
      for (RouteAlgo algo : {RouteAlgo::Warp, RouteAlgo::Block}) {
        uint32_t seed = 600;
        run_route(256, 8, seed++, kernel, algo);
        run_route(200, 8, seed++, kernel, algo);
        run_route(512, 16, seed++, kernel, algo);
        run_route(40, 4, seed++, kernel, algo);
        run_route(3, 3, seed++, kernel, algo);
      }
  });
}

}  // namespace
}  // namespace kestrel::cuda::test
