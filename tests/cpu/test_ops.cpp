// Each CPU op against a naive float64 loop on random inputs, and the chunked gated delta rule
// against the token-by-token recurrence (nonzero initial state, chunk tails).
#include "core/dtype.h"
#include "cpu/ops.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kestrel {
namespace {

using namespace cpu;

// max|a - b| / max(max|b|, tiny)
double rel(const std::vector<float>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double md = 0, mr = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(std::isfinite(a[i])) << "index " << i;
    md = std::max(md, std::abs(a[i] - b[i]));
    mr = std::max(mr, std::abs(b[i]));
  }
  return md / mr;
}
double rel(const std::vector<float>& a, const std::vector<float>& b) {
  return rel(a, std::vector<double>(b.begin(), b.end()));
}

double silu64(double x) { return x / (1 + std::exp(-x)); }

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = f32_to_bf16(v[i]);
  return o;
}

TEST(CpuOps, MatmulAllFormats) {
  for (int64_t T : {1, 3, 17}) {
    const int64_t N = 37, K = 128;
    auto wf = random_vec(size_t(N * K), 1, 0.1f);
    auto x = random_vec(size_t(T * K), 2);
    auto wb = to_bf16(wf);
    std::vector<uint16_t> wh(wf.size());
    // f16 bits of small normal values: build via bf16 upcast then a manual f16 encode is overkill;
    // use values exactly representable in both (bf16-rounded, magnitude >= 2^-14).
    for (size_t i = 0; i < wf.size(); ++i) {
      float v = bf16_to_f32(wb[i]);
      if (std::abs(v) < 1.0f / 16384) v = 0, wb[i] = 0;
      wf[i] = v;
      uint32_t u;
      std::memcpy(&u, &v, 4);
      const uint32_t sign = (u >> 16) & 0x8000u;
      const int e = int((u >> 23) & 0xff) - 127 + 15;
      wh[i] = v == 0 ? 0 : uint16_t(sign | uint32_t(e) << 10 | ((u >> 13) & 0x3ffu));
    }
    std::vector<double> ref(size_t(T * N));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += double(wf[size_t(n * K + k)]) * x[size_t(t * K + k)];
        ref[size_t(t * N + n)] = s;
      }
    for (WFormat f : {WFormat::BF16, WFormat::F16, WFormat::F32}) {
      Mat m{f, N, K, f == WFormat::BF16 ? (const void*)wb.data()
                     : f == WFormat::F16 ? (const void*)wh.data() : (const void*)wf.data()};
      std::vector<float> y(size_t(T * N), NAN);
      matmul(m, x.data(), T, y.data());
      EXPECT_LE(rel(y, ref), 1e-6) << wformat_name(f) << " T=" << T;
    }
  }
}

TEST(CpuOps, Norms) {
  const int64_t T = 5, n = 96;
  auto x = random_vec(size_t(T * n), 3, 2.f), w = random_vec(size_t(n), 4), z = random_vec(size_t(T * n), 5);
  std::vector<float> y(x.size());
  std::vector<double> r(x.size()), rg(x.size());
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[size_t(t * n + i)]) * x[size_t(t * n + i)];
    const double inv = 1 / std::sqrt(ss / n + 1e-6);
    for (int64_t i = 0; i < n; ++i) {
      r[size_t(t * n + i)] = x[size_t(t * n + i)] * inv * w[size_t(i)];
      rg[size_t(t * n + i)] = r[size_t(t * n + i)] * silu64(z[size_t(t * n + i)]);
    }
  }
  rmsnorm(x.data(), w.data(), T, n, 1e-6f, y.data());
  EXPECT_LE(rel(y, r), 1e-6);
  gated_rmsnorm(x.data(), z.data(), w.data(), T, n, 1e-6f, y.data());
  EXPECT_LE(rel(y, rg), 1e-6);
  // l2norm with scale
  std::vector<float> l = x;
  l2norm_rows(l.data(), T, n, 1e-6f, 0.25f);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[size_t(t * n + i)]) * x[size_t(t * n + i)];
    for (int64_t i = 0; i < n; ++i) r[size_t(t * n + i)] = x[size_t(t * n + i)] / std::sqrt(ss + 1e-6) * 0.25;
  }
  EXPECT_LE(rel(l, r), 1e-6);
}

TEST(CpuOps, Conv1dCarriesState) {
  const int64_t C = 40, T = 9;
  const int K = 4;
  auto x = random_vec(size_t(T * C), 6), w = random_vec(size_t(C * K), 7);
  auto st0 = random_vec(size_t(C * (K - 1)), 8);
  // Reference: the stream [state, x] convolved, tap K-1 on the current token.
  std::vector<double> ref(size_t(T * C));
  for (int64_t c = 0; c < C; ++c) {
    std::vector<double> s;
    for (int j = 0; j < K - 1; ++j) s.push_back(st0[size_t(c * (K - 1) + j)]);
    for (int64_t t = 0; t < T; ++t) s.push_back(x[size_t(t * C + c)]);
    for (int64_t t = 0; t < T; ++t) {
      double a = 0;
      for (int j = 0; j < K; ++j) a += w[size_t(c * K + j)] * s[size_t(t + j)];
      ref[size_t(t * C + c)] = silu64(a);
    }
  }
  // In two pieces (prefill 6, then 3 steps of 1) to exercise the carried window.
  std::vector<float> st = st0, u(size_t(T * C));
  conv1d_silu(x.data(), 6, C, K, w.data(), st.data(), u.data());
  for (int64_t t = 6; t < T; ++t)
    conv1d_silu(x.data() + t * C, 1, C, K, w.data(), st.data(), u.data() + t * C);
  EXPECT_LE(rel(u, ref), 1e-6);
  for (int64_t c = 0; c < C; ++c)
    for (int j = 0; j < K - 1; ++j)
      EXPECT_EQ(st[size_t(c * (K - 1) + j)], x[size_t((T - (K - 1) + j) * C + c)]);
}

TEST(CpuOps, RopeNeox) {
  const int64_t T = 3;
  const int heads = 2, D = 32, rot = 8;
  auto x = random_vec(size_t(T * heads * D), 9);
  auto y = x;
  rope_neox(y.data(), T, heads, D, rot, 1000, 1e7);
  std::vector<double> r(x.begin(), x.end());
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < rot / 2; ++i) {
        const double f = std::pow(1e7, -2.0 * i / rot), a = (1000 + t) * f;
        const size_t b = size_t((t * heads + h) * D);
        const double x1 = x[b + size_t(i)], x2 = x[b + size_t(i + rot / 2)];
        r[b + size_t(i)] = x1 * std::cos(a) - x2 * std::sin(a);
        r[b + size_t(i + rot / 2)] = x2 * std::cos(a) + x1 * std::sin(a);
      }
  EXPECT_LE(rel(y, r), 2e-5);  // fp32 angles, as the reference computes them
}

TEST(CpuOps, AttentionCausalGqa) {
  const int64_t T = 4, pos0 = 5, n = pos0 + T;
  const int H = 8, Hkv = 2, D = 16;
  auto q = random_vec(size_t(T * H * D), 10), kc = random_vec(size_t(n * Hkv * D), 11),
       vc = random_vec(size_t(n * Hkv * D), 12);
  std::vector<float> o(q.size());
  attention(q.data(), T, pos0, kc.data(), vc.data(), H, Hkv, D, o.data());
  std::vector<double> r(q.size());
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      const int kv = h / (H / Hkv);
      std::vector<double> s;
      double mx = -1e300;
      for (int64_t j = 0; j <= pos0 + t; ++j) {
        double a = 0;
        for (int d = 0; d < D; ++d) a += double(q[size_t((t * H + h) * D + d)]) * kc[size_t((j * Hkv + kv) * D + d)];
        s.push_back(a / std::sqrt(double(D)));
        mx = std::max(mx, s.back());
      }
      double sum = 0;
      for (auto& v : s) sum += (v = std::exp(v - mx));
      for (int d = 0; d < D; ++d) {
        double a = 0;
        for (size_t j = 0; j < s.size(); ++j) a += s[j] / sum * vc[size_t((int64_t(j) * Hkv + kv) * D + d)];
        r[size_t((t * H + h) * D + d)] = a;
      }
    }
  EXPECT_LE(rel(o, r), 1e-6);
}

// float64 recurrence of the gated delta rule (model-spec §3.4 step 7).
std::vector<double> gdn_ref64(const GdnDims& d, int64_t T, const std::vector<float>& q,
                              const std::vector<float>& k, const std::vector<float>& v,
                              const std::vector<float>& beta, const std::vector<float>& g,
                              std::vector<double>& S) {
  std::vector<double> o(size_t(T * d.Hv * d.dv));
  for (int j = 0; j < d.Hv; ++j) {
    const int hk = j / (d.Hv / d.Hk);
    double* Sj = S.data() + size_t(j) * d.dk * d.dv;
    for (int64_t t = 0; t < T; ++t) {
      const double a = std::exp(double(g[size_t(t * d.Hv + j)])), b = beta[size_t(t * d.Hv + j)];
      for (int i = 0; i < d.dk * d.dv; ++i) Sj[i] *= a;
      for (int i = 0; i < d.dv; ++i) {
        double m = 0;
        for (int r = 0; r < d.dk; ++r) m += Sj[r * d.dv + i] * k[size_t((t * d.Hk + hk) * d.dk + r)];
        const double delta = b * (v[size_t((t * d.Hv + j) * d.dv + i)] - m);
        for (int r = 0; r < d.dk; ++r) Sj[r * d.dv + i] += k[size_t((t * d.Hk + hk) * d.dk + r)] * delta;
      }
      for (int i = 0; i < d.dv; ++i) {
        double s = 0;
        for (int r = 0; r < d.dk; ++r) s += Sj[r * d.dv + i] * q[size_t((t * d.Hk + hk) * d.dk + r)];
        o[size_t((t * d.Hv + j) * d.dv + i)] = s;
      }
    }
  }
  return o;
}

struct GdnInputs {
  std::vector<float> q, k, v, beta, g, S0;
};

GdnInputs gdn_inputs(const GdnDims& d, int64_t T, uint64_t seed) {
  GdnInputs in;
  in.q = random_vec(size_t(T * d.Hk * d.dk), seed);
  in.k = random_vec(size_t(T * d.Hk * d.dk), seed + 1);
  in.v = random_vec(size_t(T * d.Hv * d.dv), seed + 2);
  l2norm_rows(in.q.data(), T * d.Hk, d.dk, 1e-6f, 1.f / std::sqrt(float(d.dk)));
  l2norm_rows(in.k.data(), T * d.Hk, d.dk, 1e-6f, 1.f);
  auto b = random_vec(size_t(T * d.Hv), seed + 3), a = random_vec(size_t(T * d.Hv), seed + 4);
  for (size_t i = 0; i < b.size(); ++i) {
    in.beta.push_back(sigmoid(b[i]));
    in.g.push_back(-std::exp(0.5f) * softplus(a[i]));
  }
  in.S0 = random_vec(size_t(d.Hv * d.dk * d.dv), seed + 5, 0.5f);
  return in;
}

TEST(CpuOps, GdnRecurrentMatchesFloat64) {
  const GdnDims d{2, 4, 16, 16};
  const int64_t T = 13;
  auto in = gdn_inputs(d, T, 100);
  std::vector<double> S64(in.S0.begin(), in.S0.end());
  auto ref = gdn_ref64(d, T, in.q, in.k, in.v, in.beta, in.g, S64);
  std::vector<float> S = in.S0, o(ref.size());
  gdn_recurrent(d, T, in.q.data(), in.k.data(), in.v.data(), in.beta.data(), in.g.data(), S.data(), o.data());
  EXPECT_LE(rel(o, ref), 1e-5);
  EXPECT_LE(rel(S, S64), 1e-5);
}

// The chunked (WY) form equals the recurrence: real GDN head dims, chunk 64, lengths on both sides
// of the chunk boundaries, nonzero initial state.
TEST(CpuOps, GdnChunkedMatchesRecurrent) {
  for (const GdnDims d : {GdnDims{2, 4, 32, 32}, GdnDims{1, 2, 128, 128}}) {
    for (int64_t T : {1, 7, 63, 64, 65, 130}) {
      SCOPED_TRACE(::testing::Message() << "dk=" << d.dk << " T=" << T);
      auto in = gdn_inputs(d, T, 200 + uint64_t(T));
      std::vector<float> S1 = in.S0, S2 = in.S0, o1(size_t(T * d.Hv * d.dv)), o2(o1.size());
      gdn_recurrent(d, T, in.q.data(), in.k.data(), in.v.data(), in.beta.data(), in.g.data(), S1.data(), o1.data());
      gdn_chunked(d, T, in.q.data(), in.k.data(), in.v.data(), in.beta.data(), in.g.data(), S2.data(), o2.data(), 64);
      EXPECT_LE(rel(o2, o1), 1e-5);
      EXPECT_LE(rel(S2, S1), 1e-5);
    }
  }
  // Small chunks (4) exercise many chunk transitions.
  const GdnDims d{2, 4, 16, 16};
  auto in = gdn_inputs(d, 11, 300);
  std::vector<double> S64(in.S0.begin(), in.S0.end());
  auto ref = gdn_ref64(d, 11, in.q, in.k, in.v, in.beta, in.g, S64);
  std::vector<float> S = in.S0, o(ref.size());
  gdn_chunked(d, 11, in.q.data(), in.k.data(), in.v.data(), in.beta.data(), in.g.data(), S.data(), o.data(), 4);
  EXPECT_LE(rel(o, ref), 1e-5);
  EXPECT_LE(rel(S, S64), 1e-5);
}

}  // namespace
}  // namespace kestrel
