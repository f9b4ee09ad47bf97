// CPU reference ops (fp32), the oracle of the CUDA kernels. Formulas follow model-spec §3 and
// transformers' qwen3_5_moe torch paths; every loop is plain so it can be read against the spec.
#include "cpu/ops.h"

#include "core/check.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace kestrel::cpu {

namespace {

// fp32 dot product with 8 independent accumulators (vectorises without -ffast-math).
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void matmul(const Mat& W, const float* x, int64_t T, float* y) {
  KESTREL_CHECK(W.valid(), "matmul: empty weight");
  const int64_t N = W.rows, K = W.cols;
  if (T == 0 || N == 0) return;
  // Rows in blocks of 16 per thread: one dequantised row buffer per thread, reused for all T.
  const int64_t block = 16;
  const int64_t nblocks = (N + block - 1) / block;
  const bool parallel = N * K * std::max<int64_t>(T, 1) >= (int64_t(1) << 15);
#pragma omp parallel if (parallel)
  {
    thread_local std::vector<float> row;  // per-thread scratch, grows once
    row.resize(size_t(K) * block);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t r0 = b * block, r1 = std::min(N, r0 + block);
      for (int64_t r = r0; r < r1; ++r) W.row_f32(r, row.data() + (r - r0) * K);
      for (int64_t t = 0; t < T; ++t) {
        const float* xt = x + t * K;
        float* yt = y + t * N;
        for (int64_t r = r0; r < r1; ++r) yt[r] = dot(row.data() + (r - r0) * K, xt, K);
      }
    }
  }
}

void rmsnorm(const float* x, const float* w, int64_t T, int64_t n, float eps, float* y) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xt[i]) * xt[i];
    const float inv = 1.f / std::sqrt(float(ss / double(n)) + eps);
    float* yt = y + t * n;
    for (int64_t i = 0; i < n; ++i) yt[i] = xt[i] * inv * w[i];
  }
}

void gated_rmsnorm(const float* o, const float* z, const float* w, int64_t rows, int64_t n,
                   float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* orow = o + r * n;
    const float* zrow = z + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(orow[i]) * orow[i];
    const float inv = 1.f / std::sqrt(float(ss / double(n)) + eps);
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = (w[i] * (orow[i] * inv)) * silu(zrow[i]);
  }
}

void conv1d_silu(const float* x, int64_t T, int64_t C, int K, const float* w, float* state,
                 float* u) {
  const int H = K - 1;  // history length
#pragma omp parallel for schedule(static) if (C * T >= 4096)
  for (int64_t c = 0; c < C; ++c) {
    float* st = state + c * H;
    const float* wc = w + c * K;
    for (int64_t t = 0; t < T; ++t) {
      const float xt = x[t * C + c];
      float acc = wc[K - 1] * xt;
      for (int j = 0; j < H; ++j) acc += wc[j] * st[j];
      u[t * C + c] = silu(acc);
      for (int j = 0; j + 1 < H; ++j) st[j] = st[j + 1];
      if (H > 0) st[H - 1] = xt;
    }
  }
}

void l2norm_rows(float* x, int64_t rows, int64_t n, float eps, float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
    const float inv = 1.f / std::sqrt(float(ss) + eps) * scale;
    for (int64_t i = 0; i < n; ++i) xr[i] *= inv;
  }
}

void gdn_recurrent(const GdnDims& d, int64_t T, const float* q, const float* k, const float* v,
                   const float* beta, const float* g, float* S, float* o) {
  const int ratio = d.Hv / d.Hk;
#pragma omp parallel for schedule(static) if (d.Hv * d.dk * d.dv * T >= 65536)
  for (int j = 0; j < d.Hv; ++j) {
    const int hk = j / ratio;
    float* Sj = S + int64_t(j) * d.dk * d.dv;  // [dk, dv]
    thread_local std::vector<float> mem, delta;
    mem.resize(size_t(d.dv));
    delta.resize(size_t(d.dv));
    for (int64_t t = 0; t < T; ++t) {
      const float* qt = q + (t * d.Hk + hk) * d.dk;
      const float* kt = k + (t * d.Hk + hk) * d.dk;
      const float* vt = v + (t * d.Hv + j) * d.dv;
      const float decay = std::exp(g[t * d.Hv + j]);
      const float b = beta[t * d.Hv + j];
      std::fill(mem.begin(), mem.end(), 0.f);
      for (int r = 0; r < d.dk; ++r) {
        float* Sr = Sj + int64_t(r) * d.dv;
        for (int i = 0; i < d.dv; ++i) {
          Sr[i] *= decay;
          mem[size_t(i)] += Sr[i] * kt[r];
        }
      }
      for (int i = 0; i < d.dv; ++i) delta[size_t(i)] = (vt[i] - mem[size_t(i)]) * b;
      float* ot = o + (t * d.Hv + j) * d.dv;
      std::fill(ot, ot + d.dv, 0.f);
      for (int r = 0; r < d.dk; ++r) {
        float* Sr = Sj + int64_t(r) * d.dv;
        for (int i = 0; i < d.dv; ++i) {
          Sr[i] += kt[r] * delta[size_t(i)];
          ot[i] += Sr[i] * qt[r];
        }
      }
    }
  }
}

void gdn_chunked(const GdnDims& d, int64_t T, const float* q, const float* k, const float* v,
                 const float* beta, const float* g, float* S, float* o, int chunk) {
  KESTREL_CHECK(chunk > 0, "gdn_chunked: chunk {}", chunk);
  const int ratio = d.Hv / d.Hk;
  const int dk = d.dk, dv = d.dv;
#pragma omp parallel for schedule(static) if (d.Hv * dk * dv * T >= 65536)
  for (int j = 0; j < d.Hv; ++j) {
    const int hk = j / ratio;
    float* Sj = S + int64_t(j) * dk * dv;  // [dk, dv]
    const size_t C = size_t(chunk);
    thread_local std::vector<float> G, A, P, U, W, Vn, kb;  // per-thread scratch
    G.resize(C), A.resize(C * C), P.resize(C * C), U.resize(C * size_t(dv));
    W.resize(C * size_t(dk)), Vn.resize(C * size_t(dv)), kb.resize(C * size_t(dk));
    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
      const int L = int(std::min<int64_t>(chunk, T - c0));  // padded tail positions contribute 0
      auto Q = [&](int i) { return q + ((c0 + i) * d.Hk + hk) * dk; };
      auto Kp = [&](int i) { return k + ((c0 + i) * d.Hk + hk) * dk; };
      auto Vp = [&](int i) { return v + ((c0 + i) * d.Hv + j) * dv; };
      auto B = [&](int i) { return beta[(c0 + i) * d.Hv + j]; };
      float cum = 0;
      for (int i = 0; i < L; ++i) {
        cum += g[(c0 + i) * d.Hv + j];
        G[size_t(i)] = cum;
      }
      for (int i = 0; i < L; ++i)
        for (int r = 0; r < dk; ++r) kb[size_t(i) * dk + r] = Kp(i)[r] * B(i);
      for (int i = 0; i < L; ++i) {
        for (int jj = 0; jj < L; ++jj) {
          const float decay = jj <= i ? std::exp(G[size_t(i)] - G[size_t(jj)]) : 0.f;
          A[size_t(i) * C + jj] = jj < i ? dot(kb.data() + size_t(i) * dk, Kp(jj), dk) * decay : 0.f;
          P[size_t(i) * C + jj] = jj <= i ? dot(Q(i), Kp(jj), dk) * decay : 0.f;
        }
      }
      // U = (I + A)^-1 (v * beta), W = (I + A)^-1 (k * beta * exp(G)): forward substitution.
      for (int i = 0; i < L; ++i) {
        float* Ui = U.data() + size_t(i) * dv;
        float* Wi = W.data() + size_t(i) * dk;
        for (int x = 0; x < dv; ++x) Ui[x] = Vp(i)[x] * B(i);
        const float eg = std::exp(G[size_t(i)]);
        for (int x = 0; x < dk; ++x) Wi[x] = kb[size_t(i) * dk + x] * eg;
        for (int jj = 0; jj < i; ++jj) {
          const float a = A[size_t(i) * C + jj];
          if (a == 0.f) continue;
          const float* Uj = U.data() + size_t(jj) * dv;
          const float* Wj = W.data() + size_t(jj) * dk;
          for (int x = 0; x < dv; ++x) Ui[x] -= a * Uj[x];
          for (int x = 0; x < dk; ++x) Wi[x] -= a * Wj[x];
        }
      }
      // V' = U - W S
      for (int i = 0; i < L; ++i) {
        float* Vi = Vn.data() + size_t(i) * dv;
        const float* Wi = W.data() + size_t(i) * dk;
        for (int x = 0; x < dv; ++x) Vi[x] = U[size_t(i) * dv + x];
        for (int r = 0; r < dk; ++r) {
          const float wr = Wi[r];
          const float* Sr = Sj + int64_t(r) * dv;
          for (int x = 0; x < dv; ++x) Vi[x] -= wr * Sr[x];
        }
      }
      // O = (q * exp(G)) S + P V'
      for (int i = 0; i < L; ++i) {
        float* oi = o + ((c0 + i) * d.Hv + j) * dv;
        const float eg = std::exp(G[size_t(i)]);
        std::fill(oi, oi + dv, 0.f);
        for (int r = 0; r < dk; ++r) {
          const float qr = Q(i)[r] * eg;
          const float* Sr = Sj + int64_t(r) * dv;
          for (int x = 0; x < dv; ++x) oi[x] += qr * Sr[x];
        }
        for (int jj = 0; jj <= i; ++jj) {
          const float p = P[size_t(i) * C + jj];
          const float* Vj = Vn.data() + size_t(jj) * dv;
          for (int x = 0; x < dv; ++x) oi[x] += p * Vj[x];
        }
      }
      // S = exp(G_last) S + (k * exp(G_last - G))^T V'
      const float Gl = G[size_t(L - 1)];
      const float el = std::exp(Gl);
      for (int r = 0; r < dk; ++r) {
        float* Sr = Sj + int64_t(r) * dv;
        for (int x = 0; x < dv; ++x) Sr[x] *= el;
        for (int i = 0; i < L; ++i) {
          const float kr = Kp(i)[r] * std::exp(Gl - G[size_t(i)]);
          const float* Vi = Vn.data() + size_t(i) * dv;
          for (int x = 0; x < dv; ++x) Sr[x] += kr * Vi[x];
        }
      }
    }
  }
}

void rope_neox(float* x, int64_t T, int heads, int D, int rot, int64_t pos0, double theta) {
  const int half = rot / 2;
  thread_local std::vector<float> inv;
  inv.resize(size_t(half));
  // As transformers: inv_freq = 1 / theta^(2i/rot) in fp32; angle = pos * inv_freq in fp32.
  for (int i = 0; i < half; ++i)
    inv[size_t(i)] = 1.f / std::pow(float(theta), float(2 * i) / float(rot));
  for (int64_t t = 0; t < T; ++t) {
    const float p = float(pos0 + t);
    for (int i = 0; i < half; ++i) {
      const float ang = p * inv[size_t(i)];
      const float c = std::cos(ang), s = std::sin(ang);
      for (int h = 0; h < heads; ++h) {
        float* xh = x + (t * heads + h) * D;
        const float x1 = xh[i], x2 = xh[i + half];
        xh[i] = x1 * c - x2 * s;
        xh[i + half] = x2 * c + x1 * s;
      }
    }
  }
}

void attention(const float* q, int64_t T, int64_t pos0, const float* kc, const float* vc, int H,
               int Hkv, int D, float* out) {
  const int group = H / Hkv;
  const float scale = 1.f / std::sqrt(float(D));
#pragma omp parallel for collapse(2) schedule(dynamic) if (T * H * (pos0 + T) * D >= 65536)
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      const int kvh = h / group;
      const int64_t n = pos0 + t + 1;  // causal: keys 0..pos0+t
      thread_local std::vector<float> sc;
      sc.resize(size_t(n));
      const float* qh = q + (t * H + h) * D;
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        sc[size_t(j)] = dot(qh, kc + (j * Hkv + kvh) * D, D) * scale;
        mx = std::max(mx, sc[size_t(j)]);
      }
      double sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        sc[size_t(j)] = std::exp(sc[size_t(j)] - mx);
        sum += sc[size_t(j)];
      }
      float* oh = out + (t * H + h) * D;
      std::fill(oh, oh + D, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float p = float(sc[size_t(j)] / sum);
        const float* vj = vc + (j * Hkv + kvh) * D;
        for (int x = 0; x < D; ++x) oh[x] += p * vj[x];
      }
    }
  }
}

void moe(const MoeWeights& w, const ModelConfig& cfg, const float* h, int64_t T, float* out) {
  const int64_t Hd = cfg.hidden_size, E = cfg.num_experts, k = cfg.num_experts_per_tok;
  const int64_t I = cfg.moe_intermediate_size, Is = cfg.shared_expert_intermediate_size;
  // Router: fp32 softmax over all experts, top-k (descending, lower index first on ties),
  // renormalised.
  // Scratch persists across calls (no allocation per token once warm).
  thread_local std::vector<float> logits, p, xs, gate, up, down, sg, su, sd, sgate;
  thread_local std::vector<std::vector<std::pair<int64_t, float>>> by_expert;  // (token, weight)
  thread_local std::vector<int64_t> idx;
  logits.resize(size_t(T * E));
  matmul(w.router, h, T, logits.data());
  by_expert.resize(size_t(E));
  for (auto& b : by_expert) b.clear();
  idx.resize(size_t(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* lt = logits.data() + t * E;
    const float mx = *std::max_element(lt, lt + E);
    p.resize(size_t(E));
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (p[size_t(e)] = std::exp(lt[e] - mx));
    for (auto& x : p) x = float(x / sum);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int64_t a, int64_t b) {
      return p[size_t(a)] != p[size_t(b)] ? p[size_t(a)] > p[size_t(b)] : a < b;
    });
    float top = 0;
    for (int64_t i = 0; i < k; ++i) top += p[size_t(idx[size_t(i)])];
    for (int64_t i = 0; i < k; ++i)
      by_expert[size_t(idx[size_t(i)])].push_back({t, p[size_t(idx[size_t(i)])] / top});
  }
  std::fill(out, out + T * Hd, 0.f);
  // Routed experts in ascending index order (the reference's accumulation order).
  for (int64_t e = 0; e < E; ++e) {
    const auto& toks = by_expert[size_t(e)];
    if (toks.empty()) continue;
    const int64_t n = int64_t(toks.size());
    xs.resize(size_t(n * Hd));
    for (int64_t i = 0; i < n; ++i)
      std::copy(h + toks[size_t(i)].first * Hd, h + (toks[size_t(i)].first + 1) * Hd,
                xs.begin() + i * Hd);
    gate.resize(size_t(n * I));
    up.resize(size_t(n * I));
    down.resize(size_t(n * Hd));
    matmul(w.gate[size_t(e)], xs.data(), n, gate.data());
    matmul(w.up[size_t(e)], xs.data(), n, up.data());
    for (size_t i = 0; i < gate.size(); ++i) gate[i] = silu(gate[i]) * up[i];
    matmul(w.down[size_t(e)], gate.data(), n, down.data());
    for (int64_t i = 0; i < n; ++i) {
      float* o = out + toks[size_t(i)].first * Hd;
      const float wt = toks[size_t(i)].second;
      for (int64_t x = 0; x < Hd; ++x) o[x] += down[size_t(i * Hd + x)] * wt;
    }
  }
  // Shared expert with its sigmoid gate.
  sg.resize(size_t(T * Is)), su.resize(size_t(T * Is)), sd.resize(size_t(T * Hd)), sgate.resize(size_t(T));
  matmul(w.shared_gate, h, T, sg.data());
  matmul(w.shared_up, h, T, su.data());
  for (size_t i = 0; i < sg.size(); ++i) sg[i] = silu(sg[i]) * su[i];
  matmul(w.shared_down, sg.data(), T, sd.data());
  matmul(w.shared_expert_gate, h, T, sgate.data());
  for (int64_t t = 0; t < T; ++t) {
    const float s = sigmoid(sgate[size_t(t)]);
    for (int64_t x = 0; x < Hd; ++x) out[t * Hd + x] += s * sd[size_t(t * Hd + x)];
  }
}

}  // namespace kestrel::cpu
