// What a decode GEMV can reach at the model's real shapes on this GPU: one q4 GEMV y = W x
// (RmsNorm of x folded in, as the decode step's input projections), timed in several launch
// shapes that differ only in how the work is laid out, with the project's own dot-product core
// (src/cuda/gemv_core.cuh). Variants:
//   v1      one weight row per warp, x staged (norm) before the first weight load (the decode route)
//   lf      the same with each warp's first rows' loads issued before the staging
//   lfR2/R4 2 / 4 rows per warp in flight (loads first)
//   h16R2   half-warp rows (16 lanes per row), 2 per half-warp in flight
//   b128    128-thread blocks, loads first; b512R2: 512-thread blocks, 2 rows per warp
//   nonorm  v1 without the norm's block reduction
//   stream  R4 with no staging at all (x = 1 in shared memory): the weight-streaming ceiling
// The weights rotate over enough copies to exceed L2, so every launch reads from DRAM as the
// decode step does. Each figure: a graph of kNodes launches replayed kReps times, median / kNodes.
// Every variant's output is compared with v1's. Build and run (tools/gpu_check.sh stage 4 does):
//   nvcc -O3 -std=c++20 -Isrc --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a tools/device/gemv_probe.cu -o gemv_probe
// Then the decode route's own GEMV (src/cuda/gemv.cu, compiled into this file) on the same shapes
// with its real segments, prologues, epilogues and the MoE routing tail, so that the cost of each
// of those over the bare layout is measured ("production"), and the same on GEMV route 3
// ("production_v3"), and on route 5 at 1 and 2 blocks per SM ("production_v5", "production_v5x2").
#include "cuda/gemv.cu"

#include "probe_engine.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace kestrel::cuda;
// (A named namespace: gemv.cu's anonymous one is in this translation unit too.)

#define CK(x) PROBE_CK(x)

namespace probe {

constexpr int kNodes = 60;
constexpr int kReps = 11;
constexpr float kEps = 1e-6f;

// Stages x (RmsNorm with nw when kNorm; x = 1 when kStream) into the swizzled shared layout.
template <int K, bool kNorm, bool kStream>
__device__ __forceinline__ void stage(const float* x, const float* nw, float* xs, float* xsum, float* red) {
  constexpr int F4 = K / 4;
  const int nt = blockDim.x;
  if constexpr (kStream) {
    for (int sl = threadIdx.x; sl < F4; sl += nt) smem_store4(xs, xsum, K, 0, sl, make_float4(1.f, 1.f, 1.f, 1.f));
  } else {
    constexpr int kMaxNV = F4 / 128;  // blockDim >= 128
    float4 v[kMaxNV];
    const int nv = F4 / nt;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxNV; ++i)
      if (i < nv) {
        v[i] = reinterpret_cast<const float4*>(x)[threadIdx.x + i * nt];
        ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
      }
    float inv = 1.f;
    if constexpr (kNorm) inv = 1.f / sqrtf(block_sum(ss, red) / float(K) + kEps);
#pragma unroll
    for (int i = 0; i < kMaxNV; ++i)
      if (i < nv) {
        const int sl = threadIdx.x + i * nt;
        float4 t = v[i];
        if constexpr (kNorm) {
          const float4 w = reinterpret_cast<const float4*>(nw)[sl];
          t = make_float4(t.x * inv * w.x, t.y * inv * w.y, t.z * inv * w.z, t.w * inv * w.w);
        }
        smem_store4(xs, xsum, K, 0, sl, t);
      }
  }
  __syncthreads();
}

// Groups of TPR lanes own rows gid + (it * R + j) * stride; R rows' loads in flight per group.
template <int K, int TPR, int R, bool kLoadsFirst, bool kNorm, bool kStream>
__global__ void probe_kernel(const __grid_constant__ DMat w, const float* x, const float* nw, float* y) {
  __shared__ float4 xs4[K / 4];
  __shared__ float xsum[K / 16];
  __shared__ float red[32];
  float* xs = reinterpret_cast<float*>(xs4);
  const int groups = blockDim.x / TPR;
  const int64_t gid = int64_t(blockIdx.x) * groups + threadIdx.x / TPR;
  const int li = threadIdx.x % TPR;
  const int64_t stride = int64_t(gridDim.x) * groups;
  const int64_t rows = w.rows;
  auto rows_of = [&](int64_t it, const DMat* (&wp)[R], int64_t (&r)[R]) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      r[j] = gid + (it * R + j) * stride;
      wp[j] = r[j] < rows ? &w : nullptr;
      if (r[j] >= rows) r[j] = 0;
    }
  };
  const SmemX X{xs, xsum, K};
  SmemX Xs[R];
#pragma unroll
  for (int j = 0; j < R; ++j) Xs[j] = X;
  auto finish = [&](const RowLoads<DFmt::Q4, K, TPR, R>& L, int64_t it) {
    float out[R];
    L.dot(Xs, li, out);
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const float v = group_sum<TPR>(out[j]);
      const int64_t r = gid + (it * R + j) * stride;
      if (li == 0 && r < rows) y[r] = v;
    }
  };
  const int64_t iters = (rows + stride * R - 1) / (stride * R);
  if constexpr (kLoadsFirst) {
    const DMat* wp[R];
    int64_t r[R];
    rows_of(0, wp, r);
    RowLoads<DFmt::Q4, K, TPR, R> L;
    L.issue(wp, r, li);
    stage<K, kNorm, kStream>(x, nw, xs, xsum, red);
    if (iters > 0) finish(L, 0);
    for (int64_t it = 1; it < iters; ++it) {
      rows_of(it, wp, r);
      RowLoads<DFmt::Q4, K, TPR, R> L2;
      L2.issue(wp, r, li);
      finish(L2, it);
    }
  } else {
    stage<K, kNorm, kStream>(x, nw, xs, xsum, red);
    for (int64_t it = 0; it < iters; ++it) {
      const DMat* wp[R];
      int64_t r[R];
      rows_of(it, wp, r);
      RowLoads<DFmt::Q4, K, TPR, R> L;
      L.issue(wp, r, li);
      finish(L, it);
    }
  }
}

struct Shape {
  const char* name;
  int64_t N;
  int K;
};

struct Copies {
  std::vector<DMat> w;
};

Copies make_copies(int64_t N, int K, size_t min_total, DFmt fmt = DFmt::Q4) {
  DMat one;
  one.fmt = fmt;
  one.rows = N;
  one.cols = K;
  const int n = int(std::max<size_t>(4, (min_total + one.nbytes() - 1) / one.nbytes()));
  Copies c;
  for (int i = 0; i < n; ++i) c.w.push_back(affine_mat(N, K, 0x9e37u + i, fmt));
  CK(cudaDeviceSynchronize());
  return c;
}

// Frees a case's weight copies and its x, norm-weight and output buffers.
void free_case(Copies& c, float* x, float* nw, float* y) {
  for (auto& w : c.w) {
    CK(cudaFree(const_cast<void*>(w.data)));
    CK(cudaFree(const_cast<uint16_t*>(w.scales)));
    CK(cudaFree(const_cast<uint16_t*>(w.biases)));
  }
  CK(cudaFree(x));
  CK(cudaFree(nw));
  CK(cudaFree(y));
}

template <class F>
double time_graph(cudaStream_t s, F&& record) {
  return probe::time_graph(s, kNodes, kReps, record);
}

struct Variant {
  const char* name;
  void (*kernel)(const DMat, const float*, const float*, float*);
  int threads;
  int rows_per_block;  // rows one block covers per iteration (grid = ceil(N / this), capped)
  bool cap;            // grid capped at 4 blocks per SM (as the decode route)
};

template <int K>
std::vector<Variant> variants() {
  return {
      {"v1", probe_kernel<K, 32, 1, false, true, false>, 256, 8, true},
      {"lf", probe_kernel<K, 32, 1, true, true, false>, 256, 8, true},
      {"lf_uncapped", probe_kernel<K, 32, 1, true, true, false>, 256, 8, false},
      {"lfR2", probe_kernel<K, 32, 2, true, true, false>, 256, 16, false},
      {"lfR4", probe_kernel<K, 32, 4, true, true, false>, 256, 32, false},
      {"h16R2", probe_kernel<K, 16, 2, true, true, false>, 256, 32, false},
      {"b128", probe_kernel<K, 32, 1, true, true, false>, 128, 4, false},
      {"b512R2", probe_kernel<K, 32, 2, true, true, false>, 512, 32, false},
      {"nonorm", probe_kernel<K, 32, 1, false, false, false>, 256, 8, true},
      {"stream", probe_kernel<K, 32, 4, true, false, true>, 256, 32, false},
  };
}

// Rows [r0, r0 + n) of w as a matrix of their own.
DMat rows_view(const DMat& w, int64_t r0, int64_t n) {
  DMat v = w;
  v.rows = n;
  v.data = static_cast<const char*>(w.data) + size_t(r0) * w.row_bytes();
  v.scales = w.scales + size_t(r0) * (w.cols / 64);
  v.biases = w.biases + size_t(r0) * (w.cols / 64);
  return v;
}

void production(cudaStream_t s) {
  gemv_init();
  constexpr int H = 2048;
  float* x = dev_floats(H, 0.5f);
  float* nw = dev_floats(4096, 1.f);
  float* y = dev_floats(size_t(248320), 0.f);
  float* y2 = dev_floats(4096, 0.f);
  float* xo = dev_floats(H, 0.f);
  float* cs = dev_floats(size_t(8192) * 3, 0.f);
  float* cw = dev_floats(size_t(8192) * 4, 0.25f);
  float* z = dev_floats(4096, 0.3f);
  float* xr = dev_floats(4096, 0.1f);
  int* ti;
  float* tw;
  unsigned* counter;
  unsigned long long* am;
  CK(cudaMalloc(&ti, 64));
  CK(cudaMalloc(&tw, 64));
  CK(cudaMalloc(&counter, 4));
  CK(cudaMemset(counter, 0, 4));
  CK(cudaMalloc(&am, 8));
  bool first = true;
  auto run = [&](const char* name, const std::vector<GemvArgs>& args, size_t bytes) {
    int64_t total = 0;
    for (int i = 0; i < args[0].nseg; ++i) total += args[0].seg[i].w.rows;
    gemv_launch(args[0], total, s);
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    const double us = time_graph(s, [&](int i) { gemv_launch(args[size_t(i) % args.size()], total, s); });
    std::printf("%s\n    \"%s\": {\"us\": %.3f, \"gb_per_s\": %.1f}", first ? "" : ",", name, us,
                double(bytes) / us * 1e-3);
    first = false;
    std::fflush(stdout);
  };
  auto normed = [&](GemvArgs& g) {
    g.M = 1;
    g.K = H;
    g.x = x;
    g.ldx = H;
    g.pro = Prologue::RmsNorm;
    g.norm_w = nw;
    g.eps = kEps;
  };
  {  // GDN input projection: qkv (ConvSilu) | z | b | a
    Copies c = make_copies(12352, H, size_t(300) << 20);
    std::vector<GemvArgs> v;
    for (const DMat& w : c.w) {
      GemvArgs g;
      normed(g);
      g.seg[0] = GemvSeg{rows_view(w, 0, 8192), Epilogue::ConvSilu, y, 8192, cs, cw, nullptr};
      g.seg[1] = GemvSeg{rows_view(w, 8192, 4096), Epilogue::Store, y + 8192, 4096, nullptr, nullptr, nullptr};
      g.seg[2] = GemvSeg{rows_view(w, 12288, 32), Epilogue::Store, y + 12288, 32, nullptr, nullptr, nullptr};
      g.seg[3] = GemvSeg{rows_view(w, 12320, 32), Epilogue::Store, y + 12320, 32, nullptr, nullptr, nullptr};
      g.nseg = 4;
      v.push_back(g);
    }
    run("gdn_in_proj_4seg", v, c.w[0].nbytes());
    for (auto& g : v) {
      g.seg[0] = GemvSeg{rows_view(g.seg[0].w, 0, 8192), Epilogue::Store, y, 8192, nullptr, nullptr, nullptr};
    }
    run("gdn_in_proj_4seg_no_conv", v, c.w[0].nbytes());
    for (auto& g : v) {
      DMat all = g.seg[0].w;
      all.rows = 12352;
      g.seg[0] = GemvSeg{all, Epilogue::Store, y, 12352, nullptr, nullptr, nullptr};
      g.nseg = 1;
    }
    run("gdn_in_proj_1seg", v, c.w[0].nbytes());
  }
  for (DFmt rf : {DFmt::Q4, DFmt::Q8}) {  // router (E = 256) | shared gate logit | shared gate | up
    Copies r = make_copies(257, H, size_t(200) << 20, rf);
    Copies sh = make_copies(1024, H, size_t(200) << 20);
    const size_t bytes = r.w[0].nbytes() + sh.w[0].nbytes();
    for (int route = 2; route >= 0; --route)  // 2: the tail with the block routing, 1: with the warp routing
      for (int xout = 1; xout >= 0; --xout) {
        if (route == 2 && !xout) continue;
        std::vector<GemvArgs> v;
        for (size_t i = 0; i < std::max(r.w.size(), sh.w.size()); ++i) {
          const DMat& rw = r.w[i % r.w.size()];
          const DMat& sw = sh.w[i % sh.w.size()];
          GemvArgs g;
          normed(g);
          if (xout) g.x_out = xo;
          g.seg[0] = GemvSeg{rows_view(rw, 0, 256), Epilogue::Store, y, 256, nullptr, nullptr, nullptr};
          g.seg[1] = GemvSeg{rows_view(rw, 256, 1), Epilogue::Store, y + 256, 1, nullptr, nullptr, nullptr};
          g.seg[2] = GemvSeg{rows_view(sw, 0, 512), Epilogue::Store, y + 512, 512, nullptr, nullptr, nullptr};
          g.seg[3] = GemvSeg{rows_view(sw, 512, 512), Epilogue::Store, y + 1024, 512, nullptr, nullptr, nullptr};
          g.nseg = 4;
          if (route) g.route = RouteTail{y, 256, 8, ti, tw, counter, route == 2 ? RouteAlgo::Block : RouteAlgo::Warp};
          v.push_back(g);
        }
        const std::string name = std::string("router_") + (rf == DFmt::Q8 ? "q8" : "q4") + (route == 2 ? "_route_block" : route ? "_route" : "_noroute") +
                                 (xout ? "_xout" : "");
        run(name.c_str(), v, bytes);
        if (!route && xout) {  // the routing as its own launch after the GEMV (two launches per node)
          int64_t total = 0;
          for (int k = 0; k < v[0].nseg; ++k) total += v[0].seg[k].w.rows;
          for (RouteAlgo al : {RouteAlgo::Warp, RouteAlgo::Block}) {
            const double us = time_graph(s, [&](int i) {
              gemv_launch(v[size_t(i) % v.size()], total, s);
              decode_route_launch(DecodeRouteArgs{y, 256, 8, ti, tw, al}, s);
            });
            std::printf(",\n    \"%s_then_route_%s_kernel\": {\"us\": %.3f, \"gb_per_s\": %.1f}", name.c_str(),
                        (al == RouteAlgo::Block ? "block" : "warp"), us, double(bytes) / us * 1e-3);
          }
        }
      }
  }
  {  // the routing kernel alone (logits already in memory): its own cost beyond an empty launch
    const std::vector<float> lg = [] {
      std::vector<float> v(256);
      for (int e = 0; e < 256; ++e) v[size_t(e)] = float((e * 37) % 256) / 64.f - 2.f;
      return v;
    }();
    CK(cudaMemcpy(y, lg.data(), 256 * 4, cudaMemcpyHostToDevice));
    for (RouteAlgo al : {RouteAlgo::Warp, RouteAlgo::Block}) {
      decode_route_launch(DecodeRouteArgs{y, 256, 8, ti, tw, al}, s);
      CK(cudaStreamSynchronize(s));
      const double us = time_graph(s, [&](int) { decode_route_launch(DecodeRouteArgs{y, 256, 8, ti, tw, al}, s); });
      std::printf(",\n    \"route_%s_alone\": {\"us\": %.3f}", (al == RouteAlgo::Block ? "block" : "warp"), us);
    }
  }
  {  // out projection: K = 4096, gated RMSNorm prologue, residual epilogue
    Copies c = make_copies(2048, 4096, size_t(300) << 20);
    std::vector<GemvArgs> v;
    for (const DMat& w : c.w) {
      GemvArgs g;
      g.M = 1;
      g.K = 4096;
      g.x = xr;
      g.ldx = 4096;
      g.pro = Prologue::GatedRmsNorm;
      g.norm_w = nw;
      g.z = z;
      g.ldz = 4096;
      g.norm_group = 128;
      g.eps = kEps;
      g.seg[0] = GemvSeg{w, Epilogue::Residual, y2, 2048, nullptr, nullptr, nullptr};
      g.nseg = 1;
      v.push_back(g);
    }
    run("out_proj_gated_residual", v, c.w[0].nbytes());
  }
  {  // lm_head: logits + argmax
    Copies c = make_copies(248320, H, size_t(300) << 20);
    std::vector<GemvArgs> v;
    for (const DMat& w : c.w) {
      GemvArgs g;
      normed(g);
      g.seg[0] = GemvSeg{w, Epilogue::Logits, y, 248320, nullptr, nullptr, am, 0};
      g.nseg = 1;
      v.push_back(g);
    }
    run("lm_head_logits_argmax", v, c.w[0].nbytes());
    for (auto& g : v) g.seg[0].argmax = nullptr;
    run("lm_head_logits", v, c.w[0].nbytes());
    for (auto& g : v) g.seg[0].epi = Epilogue::Store;
    run("lm_head_store", v, c.w[0].nbytes());
  }
}

}  // namespace probe
using namespace probe;


// Route 5's kernel in its probe variants (gemv.cu: kStreamNoDot, kStreamTrace) on
// the in_proj, out_proj and lm_head shapes (one segment each, Store epilogue), and the clock64
// timeline of its blocks: how long the requests take to issue, the staging, the wait for each
// tile, its dot, and the tail (refill + epilogue), in cycles, median over blocks.
template <int K, int FL>
void launch_stream_variant(const GemvArgs& a, int bps, cudaStream_t s) {
  static bool set = false;
  if (!set) {
    CK(cudaFuncSetAttribute(gemv_stream_kernel<K, FL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            int(StreamCfg<K>::kSmem)));
    set = true;
  }
  const int64_t tiles = stream_tiles<K>(a);
  const int blocks = int(std::min<int64_t>(tiles, int64_t(num_sms()) * bps));
  gemv_stream_kernel<K, FL><<<blocks, kStreamThreads, StreamCfg<K>::kSmem, s>>>(a, tiles);
}

template <int K>
void stream_variants_shape(cudaStream_t s, const char* name, int64_t N, bool& first) {
  Copies c = make_copies(N, K, size_t(300) << 20);
  float* x = dev_floats(K, 0.5f);
  float* nw = dev_floats(K, 1.f);
  float* y = dev_floats(size_t(N), 0.f);
  std::vector<GemvArgs> v;
  for (const DMat& w : c.w) {
    GemvArgs g;
    g.M = 1;
    g.K = K;
    g.x = x;
    g.ldx = K;
    g.pro = Prologue::RmsNorm;
    g.norm_w = nw;
    g.eps = kEps;
    g.seg[0] = GemvSeg{w, Epilogue::Store, y, N, nullptr, nullptr, nullptr};
    g.nseg = 1;
    v.push_back(g);
  }
  const size_t bytes = c.w[0].nbytes();
  for (int bps : {1, 2}) {
    auto one = [&](const char* vname, auto launch) {
      launch(v[0]);
      CK(cudaStreamSynchronize(s));
      CK(cudaGetLastError());
      const double us = time_graph(s, [&](int i) { launch(v[size_t(i) % v.size()]); });
      std::printf("%s\n    \"%s_%s_bps%d\": {\"us\": %.3f, \"gb_per_s\": %.1f}", first ? "" : ",", name, vname, bps, us,
                  double(bytes) / us * 1e-3);
      first = false;
      std::fflush(stdout);
    };
    one("ws", [&](const GemvArgs& a) { launch_stream_variant<K, 0>(a, bps, s); });
    one("ws_nodot", [&](const GemvArgs& a) { launch_stream_variant<K, kStreamNoDot>(a, bps, s); });
    one("ws_nohint", [&](const GemvArgs& a) { launch_stream_variant<K, kStreamNoHint>(a, bps, s); });
    // Timeline (one launch, weights cold in L2 after touching the other copies).
    {
      const int64_t tiles = stream_tiles<K>(v[0]);
      const int blocks = int(std::min<int64_t>(tiles, int64_t(num_sms()) * bps));
      long long* tr;
      CK(cudaMalloc(&tr, size_t(blocks) * kTraceSlots * 8));
      CK(cudaMemset(tr, 0, size_t(blocks) * kTraceSlots * 8));
      CK(cudaMemcpyToSymbol(g_stream_trace, &tr, sizeof(tr)));
      for (size_t i = 1; i < v.size(); ++i) launch_stream_variant<K, 0>(v[i], bps, s);
      launch_stream_variant<K, kStreamTrace>(v[0], bps, s);
      CK(cudaStreamSynchronize(s));
      CK(cudaGetLastError());
      std::vector<long long> h(size_t(blocks) * kTraceSlots);
      CK(cudaMemcpy(h.data(), tr, h.size() * 8, cudaMemcpyDeviceToHost));
      CK(cudaFree(tr));
      auto med = [&](auto f) {
        std::vector<long long> xs;
        for (int b = 0; b < blocks; ++b) {
          const long long* t = h.data() + size_t(b) * kTraceSlots;
          const long long d = f(t);
          if (d >= 0) xs.push_back(d);
        }
        if (xs.empty()) return -1LL;
        std::sort(xs.begin(), xs.end());
        return xs[xs.size() / 2];
      };
      // Cycles from the block's start: the producer's requests issued, x staged, and per tile
      // [data seen by consumer 0, all consumers done, epilogue done].
      std::printf(",\n    \"%s_bps%d_timeline_cycles\": {\"issued\": %lld, \"staged\": %lld, \"end\": %lld, \"tiles\": %lld",
                  name, bps, med([](const long long* t) { return t[1] - t[0]; }),
                  med([](const long long* t) { return t[2] - t[0]; }), med([](const long long* t) { return t[30] - t[0]; }),
                  med([](const long long* t) { return t[31]; }));
      for (int k = 0; k < 9; ++k) {
        const auto at = [&](int slot) {
          return med([&](const long long* t) { return t[31] <= k ? -1LL : t[slot] - t[0]; });
        };
        const long long r = at(3 + 3 * k);
        if (r < 0) break;
        std::printf(", \"t%d\": [%lld, %lld, %lld]", k, r, at(4 + 3 * k), at(5 + 3 * k));
      }
      std::printf("}");
    }
  }
  free_case(c, x, nw, y);
}

void stream_variants(cudaStream_t s) {
  gemv_init();
  bool first = true;
  stream_variants_shape<2048>(s, "in_proj", 12352, first);
  stream_variants_shape<4096>(s, "out_proj", 2048, first);
  stream_variants_shape<2048>(s, "lm_head", 248320, first);
}

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const Shape shapes[] = {{"gdn_in_proj", 12352, 2048}, {"router_shared", 1281, 2048}, {"out_proj", 2048, 4096},
                          {"lm_head", 248320, 2048}};
  std::printf("{\n  \"gpu\": \"%s\", \"sms\": %d, \"nodes\": %d, \"reps\": %d, \"format\": \"q4\",\n  \"shapes\": {",
              prop.name, sms, kNodes, kReps);
  bool first_shape = true;
  for (const Shape& sh : shapes) {
    const size_t bytes = size_t(sh.N) * sh.K / 2 + 4 * size_t(sh.N) * (sh.K / 64);
    Copies c = make_copies(sh.N, sh.K, size_t(300) << 20);
    std::vector<float> hx(size_t(sh.K)), hn(size_t(sh.K));
    for (int k = 0; k < sh.K; ++k) {
      hx[size_t(k)] = std::sin(0.37f * k) * 2.f;
      hn[size_t(k)] = 0.9f + 0.2f * std::cos(0.11f * k);
    }
    float *x, *nw, *y;
    CK(cudaMalloc(&x, sh.K * 4));
    CK(cudaMalloc(&nw, sh.K * 4));
    CK(cudaMalloc(&y, sh.N * 4));
    CK(cudaMemcpy(x, hx.data(), sh.K * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(nw, hn.data(), sh.K * 4, cudaMemcpyHostToDevice));
    std::printf("%s\n    \"%s\": {\"N\": %lld, \"K\": %d, \"bytes\": %zu, \"copies\": %zu, \"variants\": {", first_shape ? "" : ",",
                sh.name, (long long)sh.N, sh.K, bytes, c.w.size());
    first_shape = false;
    const auto vs = sh.K == 2048 ? variants<2048>() : variants<4096>();
    std::vector<float> ref;
    bool first = true;
    for (const Variant& v : vs) {
      int64_t grid = (sh.N + v.rows_per_block - 1) / v.rows_per_block;
      if (v.cap) grid = std::min<int64_t>(grid, int64_t(sms) * 4);
      grid = std::min<int64_t>(grid, 1 << 20);
      auto launch = [&](const DMat& w, float* out) {
        v.kernel<<<unsigned(grid), v.threads, 0, s>>>(w, x, nw, out);
      };
      // Correctness: against v1 (the first variant) on copy 0.
      launch(c.w[0], y);
      CK(cudaStreamSynchronize(s));
      CK(cudaGetLastError());
      std::vector<float> hy(size_t(sh.N));
      CK(cudaMemcpy(hy.data(), y, sh.N * 4, cudaMemcpyDeviceToHost));
      double err = 0, mx = 0;
      if (ref.empty()) ref = hy;
      for (size_t i = 0; i < hy.size(); ++i) {
        err = std::max(err, double(std::fabs(hy[i] - ref[i])));
        mx = std::max(mx, double(std::fabs(ref[i])));
      }
      const bool stream = std::string(v.name) == "stream";  // x = 1: a different product
      const double us = time_graph(s, [&](int i) { launch(c.w[size_t(i) % c.w.size()], y); });
      std::printf("%s\n      \"%s\": {\"us\": %.3f, \"gb_per_s\": %.1f, \"grid\": %lld, \"threads\": %d, \"max_rel_diff_vs_v1\": %s}",
                  first ? "" : ",", v.name, us, double(bytes) / us * 1e-3, (long long)grid, v.threads,
                  stream ? "null" : std::to_string(mx > 0 ? err / mx : err).c_str());
      first = false;
      std::fflush(stdout);
    }
    std::printf("\n    }}");
    free_case(c, x, nw, y);
  }
  std::printf("\n  },\n  \"production\": {");
  production(s);
  // The same launches on GEMV route 3 (tensor cores; the launches with a q8 segment stay on v1).
  g_probe_gemv_version = 3;
  std::printf("\n  },\n  \"production_v3\": {");
  production(s);
  // Route 5 (weights streamed into shared memory by bulk copies), at 1 and 2 blocks per SM.
  g_probe_gemv_version = 5;
  g_probe_stream_bps = 1;
  std::printf("\n  },\n  \"production_v5\": {");
  production(s);
  g_probe_stream_bps = 2;
  std::printf("\n  },\n  \"production_v5x2\": {");
  production(s);
  std::printf("\n  },\n  \"stream_variants\": {");
  stream_variants(s);
  std::printf("\n  }\n}\n");
  return 0;
}
