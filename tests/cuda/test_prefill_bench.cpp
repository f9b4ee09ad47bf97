// Kernel-level prefill benchmark on full-size shapes with random weights built on the GPU (no
// checkpoint): times each prefill stage of one layer of each kind for a prompt of T tokens and
// estimates the whole-prompt rate as 30 GDN layers + 10 attention layers + 40 MoE blocks + the
// lm_head of the last position. NOT included (not yet written as prefill kernels, or elementwise):
// embedding gather, the per-layer RMSNorms and residual adds, the GDN gated RMSNorm, the final norm,
// host work. Prints a table; with KESTREL_PREFILL_BENCH_DIR set, writes
// prefill_<weights>_<T>.json records there (KESTREL_GIT_SHA names the commit).
// A benchmark, not a timed test: it asserts only that every stage ran.
#include "cuda/prefill.h"
#include "util.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>

namespace kestrel::cuda::test {
namespace {

struct SynthMat {
  std::unique_ptr<DevBuf> data, scales, biases;
  DMat d;
};
std::unique_ptr<SynthMat> synth(DFmt f, int64_t rows, int64_t cols, uint64_t seed) {
  auto m = std::make_unique<SynthMat>();
  m->d.fmt = f;
  m->d.rows = rows;
  m->d.cols = cols;
  m->d.group = 64;
  const size_t n = size_t(rows * cols);
  if (f == DFmt::BF16) {
    m->data = std::make_unique<DevBuf>(n * 2);
    fill_uniform_bf16(m->data->as<uint16_t>(), n, seed, -0.035f, 0.035f, nullptr);
  } else {
    const int bits = f == DFmt::Q4 ? 4 : 8;
    m->data = std::make_unique<DevBuf>(n * size_t(bits) / 8);
    fill_random_u32(m->data->as<uint32_t>(), n * size_t(bits) / 32, seed, nullptr);
    const size_t ng = n / 64;
    m->scales = std::make_unique<DevBuf>(ng * 2);
    m->biases = std::make_unique<DevBuf>(ng * 2);
    const float s = f == DFmt::Q4 ? 0.0046f : 0.00027f;  // std ~0.02 for uniform codes
    const float levels = float((1 << bits) - 1);
    fill_uniform_bf16(m->scales->as<uint16_t>(), ng, seed + 1, 0.8f * s, 1.2f * s, nullptr);
    fill_uniform_bf16(m->biases->as<uint16_t>(), ng, seed + 2, -0.55f * s * levels,
                      -0.45f * s * levels, nullptr);
    m->d.scales = m->scales->as<uint16_t>();
    m->d.biases = m->biases->as<uint16_t>();
  }
  m->d.data = m->data->p;
  return m;
}
std::unique_ptr<DevBuf> act(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  auto b = std::make_unique<DevBuf>(n * 4);
  fill_uniform_f32(b->as<float>(), n, seed, lo, hi, nullptr);
  return b;
}

// Median of reps timed individually with events, after warm-up.
double time_ms(const std::function<void()>& f, int warm = 2, int reps = 9) {
  for (int i = 0; i < warm; ++i) f();
  KCUDA(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  KCUDA(cudaEventCreate(&e0));
  KCUDA(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    KCUDA(cudaEventRecord(e0));
    f();
    KCUDA(cudaEventRecord(e1));
    KCUDA(cudaEventSynchronize(e1));
    float x = 0;
    KCUDA(cudaEventElapsedTime(&x, e0, e1));
    ms.push_back(x);
  }
  KCUDA(cudaEventDestroy(e0));
  KCUDA(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return double(ms[ms.size() / 2]);
}

PrefillGemmArgs dense(const float* A, int64_t M, const DMat& W, float* C, GemmEpi epi = GemmEpi::Store) {
  PrefillGemmArgs a;
  a.M = M;
  a.N = W.rows;
  a.K = W.cols;
  a.A = A;
  a.lda = W.cols;
  a.W = W;
  a.epi = epi;
  a.C = C;
  a.ldc = W.rows;
  return a;
}

void bench(const char* wname, DFmt F, int64_t T) {
  const DFmt F8 = F == DFmt::BF16 ? DFmt::BF16 : DFmt::Q8;  // router, shared gate (MLX: 8-bit)
  const int64_t H = 2048, E = 256, topk = 8, I = 512, Is = 512, V = 248320;
  uint64_t seed = 1000;
  // GDN layer projections.
  auto qkv = synth(F, 8192, H, seed++), z = synth(F, 4096, H, seed++), pb = synth(F, 32, H, seed++),
       pa = synth(F, 32, H, seed++), outp = synth(F, H, 4096, seed++);
  // Attention layer projections.
  auto qp = synth(F, 8192, H, seed++), kp = synth(F, 512, H, seed++), vp = synth(F, 512, H, seed++),
       op = synth(F, H, 4096, seed++);
  // MoE.
  auto router = synth(F8, E, H, seed++), gate = synth(F, E * I, H, seed++), up = synth(F, E * I, H, seed++),
       down = synth(F, E * H, I, seed++), sg = synth(F, Is, H, seed++), su = synth(F, Is, H, seed++),
       sd = synth(F, H, Is, seed++), seg = synth(F8, 1, H, seed++);
  auto lm = synth(F, V, H, seed++);
  // Activations / scratch.
  auto h = act(size_t(T * H), seed++);
  auto x = act(size_t(T * H), seed++);
  auto y8192 = std::make_unique<DevBuf>(size_t(T * 8192) * 4), y4096 = std::make_unique<DevBuf>(size_t(T * 4096) * 4);
  auto y32a = std::make_unique<DevBuf>(size_t(T * 32) * 4), y32b = std::make_unique<DevBuf>(size_t(T * 32) * 4);
  auto a4096 = act(size_t(T * 4096), seed++);
  auto y512a = std::make_unique<DevBuf>(size_t(T * 512) * 4), y512b = std::make_unique<DevBuf>(size_t(T * 512) * 4);
  auto logits = std::make_unique<DevBuf>(size_t(V) * 4);
  auto h16 = std::make_unique<DevBuf>(size_t(T * H) * 2), a16 = std::make_unique<DevBuf>(size_t(T * 4096) * 2);
  // Dense projections read bf16 activations (the GEMM rounds to bf16 anyway): one conversion of the
  // layer input and one of the out/o_proj input per layer, timed inside the stage.
  auto dense16 = [&](const uint16_t* A, const DMat& W, float* C, GemmEpi epi = GemmEpi::Store) {
    PrefillGemmArgs a = dense(nullptr, T, W, C, epi);
    a.A = nullptr;
    a.A16 = A;
    prefill_gemm(a, nullptr);
  };

  std::map<std::string, double> st;
  const uint16_t* H16 = h16->as<uint16_t>();
  const uint16_t* A16 = a16->as<uint16_t>();
  st["gdn_proj"] = time_ms([&] {
    prefill_to_bf16(h->as<float>(), T, H, H, h16->as<uint16_t>(), H, nullptr);
    dense16(H16, qkv->d, y8192->as<float>());
    dense16(H16, z->d, y4096->as<float>());
    dense16(H16, pb->d, y32a->as<float>());
    dense16(H16, pa->d, y32b->as<float>());
    prefill_to_bf16(a4096->as<float>(), T, 4096, 4096, a16->as<uint16_t>(), 4096, nullptr);
    dense16(A16, outp->d, x->as<float>(), GemmEpi::Residual);
  });
  st["attn_proj"] = time_ms([&] {
    prefill_to_bf16(h->as<float>(), T, H, H, h16->as<uint16_t>(), H, nullptr);
    dense16(H16, qp->d, y8192->as<float>());
    dense16(H16, kp->d, y512a->as<float>());
    dense16(H16, vp->d, y512b->as<float>());
    prefill_to_bf16(a4096->as<float>(), T, 4096, 4096, a16->as<uint16_t>(), 4096, nullptr);
    dense16(A16, op->d, x->as<float>(), GemmEpi::Residual);
  });
  {
    MoePrefillWeights w;
    w.router = router->d;
    w.gate = gate->d;
    w.up = up->d;
    w.down = down->d;
    w.shared_gate = sg->d;
    w.shared_up = su->d;
    w.shared_down = sd->d;
    w.shared_expert_gate = seg->d;
    w.E = int(E);
    w.topk = int(topk);
    w.hidden = H;
    w.I = I;
    w.Is = Is;
    const int64_t S = T * topk;
    DevBuf lg(size_t(T * E) * 4), ti(size_t(S) * 4), tw(size_t(S) * 4), cn(size_t(E) * 4),
        go(size_t(E + 1) * 4), to(size_t(E + 1) * 4), so(size_t(S) * 4), ac(size_t(S * I) * 4),
        sl(size_t(S * H) * 4), sa(size_t(T * Is) * 4), sh(size_t(T * H) * 4), sgt(size_t(T) * 4);
    MoePrefillScratch sc{lg.as<float>(), ti.as<int>(),      tw.as<float>(),    cn.as<int>(),
                         go.as<int>(),   to.as<int>(),      nullptr,           so.as<int>(),      ac.as<float>(),
                         sl.as<float>(), sa.as<float>(), sh.as<float>(),
                         sgt.as<float>()};
    st["moe"] = time_ms([&] { moe_prefill(w, h->as<float>(), T, sc, x->as<float>(), true, nullptr); });
    // The routed-expert GEMMs alone (routing fixed by the last run).
    st["moe_experts_only"] = time_ms([&] {
      PrefillGemmArgs gu;
      gu.M = S;
      gu.N = I;
      gu.K = H;
      gu.A = h->as<float>();
      gu.lda = H;
      gu.a_rows = so.as<int>();
      gu.a_div = int(topk);
      gu.W = gate->d;
      gu.W2 = up->d;
      gu.epi = GemmEpi::SiluMul;
      gu.C = ac.as<float>();
      gu.ldc = I;
      gu.groups = int(E);
      gu.group_off = go.as<int>();
      gu.tile_off = to.as<int>();
      gu.max_tiles = moe_max_tiles(T, int(topk), int(E));
      prefill_gemm(gu, nullptr);
      PrefillGemmArgs dn = gu;
      dn.N = H;
      dn.K = I;
      dn.A = ac.as<float>();
      dn.lda = I;
      dn.a_rows = nullptr;
      dn.a_div = 1;
      dn.W = down->d;
      dn.W2 = DMat{};
      dn.epi = GemmEpi::Store;
      dn.C = sl.as<float>();
      dn.ldc = H;
      dn.c_rows = so.as<int>();
      dn.row_scale = tw.as<float>();
      prefill_gemm(dn, nullptr);
    });
  }
  {
    auto u = act(size_t(T * 8192), seed++, -0.5f, 0.5f);
    auto ba = act(size_t(T * 32), seed++, -2.f, 2.f), aa = act(size_t(T * 32), seed++, -2.f, 2.f);
    auto Al = act(32, seed++, -3.f, 0.f), dtb = act(32, seed++, -1.f, 1.f);
    auto cw = act(size_t(8192 * 4), seed++), cst = act(size_t(8192 * 3), seed++);
    auto S = act(size_t(32 * 128 * 128), seed++, -0.1f, 0.1f);
    auto o = std::make_unique<DevBuf>(size_t(T * 4096) * 4);
    PrefillConvArgs c;
    c.T = T;
    c.C = 8192;
    c.x = y8192->as<float>();
    c.ldx = 8192;
    c.w = cw->as<float>();
    c.state = cst->as<float>();
    c.u = u->as<float>();
    PrefillGdnArgs g;
    g.T = T;
    g.u = u->as<float>();
    g.ldu = 8192;
    g.b = ba->as<float>();
    g.a = aa->as<float>();
    g.ldb = 32;
    g.lda = 32;
    g.A_log = Al->as<float>();
    g.dt_bias = dtb->as<float>();
    g.state = S->as<float>();
    g.o = o->as<float>();
    DevBuf gsc(prefill_gdn_scratch_bytes(T, 32));
    g.scratch = gsc.as<float>();
    g.Hk = 16;
    g.Hv = 32;
    g.dk = 128;
    g.dv = 128;
    st["gdn_conv"] = time_ms([&] { prefill_conv(c, nullptr); });
    fill_uniform_f32(u->as<float>(), size_t(T * 8192), seed++, -0.5f, 0.5f, nullptr);
    st["gdn_chunk"] = time_ms([&] { prefill_gdn(g, nullptr); }, 1, 5);
  }
  {
    auto qg = act(size_t(T * 16 * 512), seed++), kr = act(size_t(T * 512), seed++), vr = act(size_t(T * 512), seed++);
    auto qn = act(256, seed++, 0.5f, 1.5f), kn = act(256, seed++, 0.5f, 1.5f);
    DevBuf qb(size_t(2 * T * 16 * 256) * 2), kc(size_t(T * 512) * 2), vc(size_t(T * 512) * 2), out(size_t(T * 4096) * 4);
    PrefillAttnArgs a;
    a.T = T;
    a.pos0 = 0;
    a.capacity = T;
    a.qg = qg->as<float>();
    a.k = kr->as<float>();
    a.v = vr->as<float>();
    a.q_norm = qn->as<float>();
    a.k_norm = kn->as<float>();
    a.qbuf = qb.as<uint16_t>();
    a.kcache = kc.as<uint16_t>();
    a.vcache = vc.as<uint16_t>();
    a.out = out.as<float>();
    a.heads = 16;
    a.kv_heads = 2;
    a.head_dim = 256;
    a.rotary_dim = 64;
    st["attn_core"] = time_ms([&] { prefill_attn(a, nullptr); });
  }
  st["lm_head_last"] = time_ms([&] {
    prefill_gemm(dense(h->as<float>() + (T - 1) * H, 1, lm->d, logits->as<float>()), nullptr);
  });
  KCUDA(cudaDeviceSynchronize());

  const double total_ms = 30 * (st["gdn_proj"] + st["gdn_conv"] + st["gdn_chunk"]) +
                          10 * (st["attn_proj"] + st["attn_core"]) + 40 * st["moe"] + st["lm_head_last"];
  // FLOPs of the weight GEMMs (2 per multiply-add), what the compute floor counts.
  const double Td = double(T);
  const double gdn_f = 2 * Td * H * (8192 + 4096 + 64) + 2 * Td * 4096 * H;
  const double attn_f = 2 * Td * H * (8192 + 1024) + 2 * Td * 4096 * H;
  const double moe_f = 2 * Td * H * E + 2 * Td * topk * 3 * I * H + 2 * Td * (3 * Is * H + H);
  const double flops = 30 * gdn_f + 10 * attn_f + 40 * moe_f + 2.0 * V * H;
  const double tok_s = Td / (total_ms * 1e-3);
  const double tflops = flops / (total_ms * 1e-3) / 1e12;
  cudaDeviceProp prop{};
  KCUDA(cudaGetDeviceProperties(&prop, 0));
  std::string shares;
  const std::map<std::string, double> per_prompt = {
      {"gdn_proj", 30 * st["gdn_proj"]}, {"gdn_conv", 30 * st["gdn_conv"]},
      {"gdn_chunk", 30 * st["gdn_chunk"]}, {"attn_proj", 10 * st["attn_proj"]},
      {"attn_core", 10 * st["attn_core"]}, {"moe", 40 * st["moe"]}, {"lm_head_last", st["lm_head_last"]}};
  std::printf("\n[prefill bench] %s T=%lld on %s\n", wname, (long long)T, prop.name);
  std::printf("  %-18s %10s %12s %8s\n", "stage", "ms/layer", "ms/prompt", "share");
  for (const auto& [k, v] : per_prompt) {
    std::printf("  %-18s %10.3f %12.2f %7.1f%%\n", k.c_str(), st[k], v, 100.0 * v / total_ms);
    shares += fmt::format("{}\"{}\": {{\"ms_per_layer\": {:.4f}, \"ms_per_prompt\": {:.3f}, \"share\": {:.4f}}}",
                          shares.empty() ? "" : ", ", k, st[k], v, v / total_ms);
  }
  const double moe_exp_f = 2 * Td * topk * 3 * I * H;
  std::printf("  moe routed-expert GEMMs alone: %.3f ms (%.1f TFLOP/s)\n", st["moe_experts_only"],
              moe_exp_f / (st["moe_experts_only"] * 1e-3) / 1e12);
  std::printf("  total %.2f ms -> %.0f tok/s, %.1f TFLOP/s on the weight GEMMs (%.1f%% of 778)\n",
              total_ms, tok_s, tflops, 100.0 * tflops / 778.0);
  EXPECT_GT(tok_s, 0.0);
  if (const char* dir = std::getenv("KESTREL_PREFILL_BENCH_DIR")) {
    const char* sha = std::getenv("KESTREL_GIT_SHA");
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    const std::string path = fmt::format("{}/prefill_{}_{}.json", dir, wname, T);
    std::ofstream f(path);
    f << fmt::format(
        "{{\"kind\": \"prefill\", \"weights\": \"{}\", \"prompt_tokens\": {}, \"tok_per_s\": {:.1f}, "
        "\"achieved_tflops\": {:.2f}, \"gpu\": \"{}\", \"git_sha\": \"{}\", \"date\": \"{}\", "
        "\"estimate\": \"30 GDN + 10 attention layers + 40 MoE blocks + last-position lm_head, each "
        "stage timed on one full-size layer with random weights built on the GPU (median of 9)\", "
        "\"not_included\": \"embedding, RMSNorms, residual adds of the mixers' inputs, GDN gated "
        "RMSNorm, final norm, host work\", \"flops_counted\": \"weight GEMMs (2 per MAC)\", "
        "\"moe_experts_only_ms\": {:.4f}, \"stages\": {{{}}}}}\n",
        wname, T, tok_s, tflops, prop.name, sha ? sha : "unknown", date, st["moe_experts_only"], shares);
    EXPECT_TRUE(f.good()) << path;
  }
}

TEST(PrefillBench, FullSizeStagesQ4AndBf16) {
  REQUIRE_GPU();
  for (int64_t T : {512, 4096}) {
    bench("q4", DFmt::Q4, T);
    bench("bf16", DFmt::BF16, T);
  }
}

}  // namespace
}  // namespace kestrel::cuda::test
