// The prompt (prefill) driver: see prefill_step.h for the sequence of kernels per chunk.
#include "cuda/prefill_step.h"

#include "cuda/kernels.h"
#include "cuda/prefill_ops.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <cstdio>

namespace kestrel::cuda {

namespace {

// Every scratch buffer of the driver for chunks of Tm tokens, in elements (one list, used both to
// allocate and to report the size before allocating).
struct ScratchPlan {
  // fp32 buffers
  size_t x, hn, proj, u, o, attn, logits;
  size_t gdn_bytes;
  size_t y;
  // bf16 buffers
  size_t qbuf;
  // MoE
  size_t moe_logits, moe_slots, moe_e1, moe_act, moe_slot_out, moe_sact, moe_shared, moe_sgate;
  // F16 route: range flag (u32 x 4) and the per-GDN-layer state snapshot
  size_t flag = 4, conv_state, rec_state, n_gdn;
  // Pipe kernel: split A, [Tm, widest GEMM input] and the routed activation [Tm * topk, I]
  size_t pipe_x, pipe_y;

  ScratchPlan(const ModelConfig& c, int64_t Tm) {
    const size_t T = size_t(Tm), H = size_t(c.hidden_size);
    const size_t C = size_t(c.gdn_conv_dim()), VD = size_t(c.gdn_value_dim());
    const size_t Hv = size_t(c.linear_num_value_heads);
    const size_t nh = size_t(c.num_attention_heads), kv = size_t(c.num_kv_heads), D = size_t(c.head_dim);
    const size_t E = size_t(c.num_experts), K = size_t(c.num_experts_per_tok);
    x = T * H;
    hn = T * H;
    proj = T * std::max(C + VD + 2 * Hv, (2 * nh + 2 * kv) * D);  // GDN in_proj | attention q|k|v
    u = T * C;
    o = T * VD;
    y = T * VD;
    gdn_bytes = prefill_gdn_scratch_bytes(Tm, int(Hv));
    qbuf = 2 * T * nh * D;  // hi and lo parts
    attn = T * nh * D;
    logits = size_t(std::max<int64_t>(kLogitRows, 1)) * size_t(c.vocab_size);
    moe_logits = T * E;
    moe_slots = T * K;
    moe_e1 = E + 1;
    moe_act = T * K * size_t(c.moe_intermediate_size);
    moe_slot_out = T * K * H;
    moe_sact = T * size_t(c.shared_expert_intermediate_size);
    moe_shared = T * H;
    moe_sgate = T;
    conv_state = C * 3;
    rec_state = Hv * size_t(c.linear_value_head_dim) * size_t(c.linear_key_head_dim);
    n_gdn = size_t(std::count(c.layer_types.begin(), c.layer_types.end(), LayerKind::LinearAttention));
    pipe_x = T * std::max({H, VD, nh * D, size_t(c.shared_expert_intermediate_size)});
    pipe_y = T * K * size_t(c.moe_intermediate_size);
  }
  size_t bytes() const {
    const size_t f32 = x + hn + proj + u + o + attn + logits + moe_logits +
                       moe_slots /* topk_w */ + moe_slot_out + moe_shared + moe_sgate + y + moe_act + moe_sact +
                       (pipe_x + pipe_y) / 64 /* split-A sums */;
    const size_t i32 = 2 * moe_slots /* topk_idx, sorted */ + 4 * moe_e1 /* counts, offsets, tails */ + flag;
    const size_t snap = n_gdn * (conv_state + rec_state);
    const size_t b16 = qbuf + 2 * (pipe_x + pipe_y) /* split-A planes */;
    return 4 * f32 + 4 * i32 + 2 * b16 + gdn_bytes + 4 * snap;
  }
};

}  // namespace

size_t prefill_step_scratch_bytes(const ModelConfig& c, int64_t max_chunk) {
  return ScratchPlan(c, max_chunk).bytes();
}

PrefillStep::PrefillStep(const DModel& m, int64_t max_chunk) : m_(m), max_chunk_(max_chunk) {
  KESTREL_CHECK(max_chunk >= 1 && max_chunk <= kPrefillMaxChunk,
                "prefill: chunk size {} outside 1..{}", max_chunk, kPrefillMaxChunk);
  const ModelConfig& c = m.cfg;
  // The GEMMs read bf16 rows of these widths (K % 64) and the norms use float4 rows.
  KESTREL_CHECK(c.hidden_size % 64 == 0 && c.gdn_value_dim() % 64 == 0 &&
                    int64_t(c.num_attention_heads) * c.head_dim % 64 == 0 &&
                    c.moe_intermediate_size % 64 == 0 && c.shared_expert_intermediate_size % 64 == 0,
                "prefill: widths hidden {} value_dim {} heads*head_dim {} experts {}/{} must be "
                "multiples of 64",
                c.hidden_size, c.gdn_value_dim(), c.num_attention_heads * c.head_dim,
                c.moe_intermediate_size, c.shared_expert_intermediate_size);
  KESTREL_CHECK(m.lm_head.rows == c.vocab_size, "prefill: lm_head has {} rows, vocabulary {}",
                m.lm_head.rows, c.vocab_size);
  prefill_init();
  kernels_init();  // the last position's lm_head is the decode GEMV
  const ScratchPlan p(c, max_chunk);
  buf_.x = take<float>(p.x);
  buf_.hn = take<float>(p.hn);
  buf_.proj = take<float>(p.proj);
  buf_.u = take<float>(p.u);
  buf_.o = take<float>(p.o);
  buf_.y = take<float>(p.y);
  buf_.gdn = take<float>(p.gdn_bytes / 4);
  buf_.qbuf = take<uint16_t>(p.qbuf);
  buf_.attn = take<float>(p.attn);
  buf_.logits = take<float>(p.logits);
  moe_.logits = take<float>(p.moe_logits);
  moe_.topk_idx = take<int>(p.moe_slots);
  moe_.topk_w = take<float>(p.moe_slots);
  moe_.counts = take<int>(p.moe_e1);
  moe_.group_off = take<int>(p.moe_e1);
  moe_.tile_off = take<int>(p.moe_e1);
  moe_.tail_off = take<int>(p.moe_e1);
  moe_.sorted = take<int>(p.moe_slots);
  moe_.act = take<float>(p.moe_act);
  moe_.slot_out = take<float>(p.moe_slot_out);
  moe_.sact = take<float>(p.moe_sact);
  moe_.shared = take<float>(p.moe_shared);
  moe_.sgate = take<float>(p.moe_sgate);
  moe_.router_logits_given = true;
  range_flag_ = take<unsigned>(4);  // 16-byte slot
  const size_t pipe_elems[2] = {p.pipe_x, p.pipe_y};
  for (int i = 0; i < 2; ++i) {
    moe_.pipe[i].hi = take<uint16_t>(pipe_elems[i]);
    moe_.pipe[i].lo = take<uint16_t>(pipe_elems[i]);
    moe_.pipe[i].sum = take<float>(pipe_elems[i] / 64);
    moe_.pipe[i].elems = int64_t(pipe_elems[i]);
  }
  snap_conv_.assign(size_t(c.num_layers), nullptr);
  snap_rec_.assign(size_t(c.num_layers), nullptr);
  for (int l = 0; l < c.num_layers; ++l)
    if (m.layers[size_t(l)].kind == LayerKind::LinearAttention) {
      snap_conv_[size_t(l)] = take<float>(p.conv_state);
      snap_rec_[size_t(l)] = take<float>(p.rec_state);
    }
  KESTREL_CHECK(arena_.bytes() == p.bytes(), "prefill: scratch plan {} B but {} B allocated", p.bytes(),
                arena_.bytes());
  set_aprec(prefill_aprec_from_env());
  gemm_choice_ = prefill_gemm_choice_from_env();
  attn_p_split_ = prefill_attn_p_split();
  router_route_ = prefill_router_route();
  attn_qk_wgmma_ = prefill_attn_qk_wgmma();
  attn_pv_wgmma_ = prefill_attn_pv_wgmma();
  attn_wide_ = prefill_attn_wide();
  KESTREL_CHECK(!attn_wide_ || (attn_qk_wgmma_ && attn_pv_wgmma_ && !attn_p_split_),
                "KESTREL_ATTN_TILE=128x64(k2) runs Q K^T and P V on wgmma with P as one bf16 plane: it does not "
                "combine with KESTREL_ATTN_P=split or KESTREL_ATTN_QK/PV=sync");
  // Measurement knob: rows per expert tile (0 = the route's default; see MoePrefillScratch).
  if (const char* e = std::getenv("KESTREL_PREFILL_MOE_BM"); e != nullptr && *e != 0) {
    moe_bm_ = std::atoi(e);
    KESTREL_CHECK(moe_bm_ == 64 || moe_bm_ == 128, "KESTREL_PREFILL_MOE_BM={}: 64 or 128", e);
  }
}

const char* prefill_gemm_choice_name(PrefillGemmChoice c) {
  return c == PrefillGemmChoice::Reg ? "reg" : c == PrefillGemmChoice::Pipe ? "pipe" : "auto";
}

namespace {
// The index of environment variable var's value in names (0, the default, when unset or empty);
// any other value is an error that lists the choices.
int env_choice(const char* var, std::initializer_list<const char*> names) {
  const char* e = std::getenv(var);
  if (e == nullptr || *e == 0) return 0;
  int i = 0;
  std::string list;
  for (const char* n : names) {
    if (std::strcmp(e, n) == 0) return i;
    list += (i++ > 0 ? ", " : "") + std::string(n);
  }
  KESTREL_CHECK(false, "{}={}: expected one of {}", var, e, list);
  return 0;
}
}  // namespace

PrefillGemmChoice prefill_gemm_choice_from_env() {
  constexpr PrefillGemmChoice c[] = {PrefillGemmChoice::Auto, PrefillGemmChoice::Reg, PrefillGemmChoice::Pipe};
  return c[env_choice("KESTREL_PREFILL_GEMM", {"auto", "reg", "pipe"})];
}

bool prefill_attn_p_split() { return env_choice("KESTREL_ATTN_P", {"bf16", "split"}) == 1; }

bool prefill_attn_qk_wgmma() { return env_choice("KESTREL_ATTN_QK", {"wgmma", "sync"}) == 0; }

bool prefill_attn_pv_wgmma() { return env_choice("KESTREL_ATTN_PV", {"wgmma", "sync"}) == 0; }

int prefill_attn_wide() { return env_choice("KESTREL_ATTN_TILE", {"64x32", "128x64", "128x64k2"}); }

PipeMma prefill_pipe_q4_mma() {
  constexpr PipeMma m[] = {PipeMma::Auto, PipeMma::Wgmma, PipeMma::Ws, PipeMma::Rs,
                           PipeMma::Sync, PipeMma::Dq,    PipeMma::Pp};
  return m[env_choice("KESTREL_PIPE_MMA", {"auto", "wgmma", "ws", "rs", "sync", "dq", "pp"})];
}

F32GemmRoute prefill_router_route() {
  return env_choice("KESTREL_ROUTER_GEMM", {"tc", "fma"}) == 0 ? F32GemmRoute::Tc : F32GemmRoute::Fma;
}

bool prefill_pipe_dq_wide() { return env_choice("KESTREL_PIPE_DQ_N", {"128", "256"}) == 1; }

bool prefill_pipe_rs_tail() { return env_choice("KESTREL_PIPE_RS_TAIL", {"0", "1"}) == 1; }

PipeWsGrid prefill_pipe_ws_grid() {
  return env_choice("KESTREL_PIPE_WS_GRID", {"persistent", "tiles"}) == 0 ? PipeWsGrid::Persistent
                                                                         : PipeWsGrid::Tiles;
}

PrefillAPrec prefill_aprec_from_env() {
  return env_choice("KESTREL_PREFILL_APREC", {"split", "f16"}) == 0 ? PrefillAPrec::Split : PrefillAPrec::F16;
}

void PrefillStep::set_aprec(PrefillAPrec p, float f16_limit) {
  // Floats are printed by std::to_string: GCC 13 reports a false -Warray-bounds inside fmt 9's
  // float formatting (bigint) when it is instantiated here.
  KESTREL_CHECK(f16_limit > 0.f && f16_limit <= kF16Max, "prefill: fp16 limit {} outside (0, 65504]",
                std::to_string(f16_limit));
  aprec_ = p;
  f16_limit_ = f16_limit;
}

// Copies the conv windows and GDN states of sq to the snapshot (or back, with restore).
void PrefillStep::snapshot(const DSeq& sq, bool restore, cudaStream_t s) {
  const ModelConfig& c = m_.cfg;
  const ScratchPlan p(c, 1);
  for (int l = 0; l < c.num_layers; ++l) {
    if (snap_conv_[size_t(l)] == nullptr) continue;
    float* live[2] = {sq.conv[size_t(l)], sq.rec[size_t(l)]};
    float* snap[2] = {snap_conv_[size_t(l)], snap_rec_[size_t(l)]};
    const size_t bytes[2] = {p.conv_state * 4, p.rec_state * 4};
    for (int i = 0; i < 2; ++i)
      KCUDA(cudaMemcpyAsync(restore ? live[i] : snap[i], restore ? snap[i] : live[i], bytes[i],
                            cudaMemcpyDeviceToDevice, s));
  }
}

void PrefillStep::poison(cudaStream_t s) {
  for (const auto& [p, bytes] : allocs_) KCUDA(cudaMemsetAsync(p, 0xff, bytes, s));
  KCUDA(cudaStreamSynchronize(s));
}

void PrefillStep::run(DSeq& sq, std::span<const int32_t> tokens, bool all_logits, float* logits,
                      cudaStream_t s) {
  const int64_t n = int64_t(tokens.size());
  KESTREL_CHECK(n >= 1 && sq.length + n <= sq.capacity,
                "prefill: {} tokens after {} exceed the sequence capacity {}", n, sq.length,
                sq.capacity);
  KESTREL_CHECK(logits != nullptr, "prefill: no logits destination");
  const int64_t V = m_.cfg.vocab_size;
  // The tokens go to the sequence's history on the device (pageable copy: the host buffer may be
  // reused once this returns); the embedding gather reads them there.
  KCUDA(cudaMemcpyAsync(sq.d_history + sq.length, tokens.data(), size_t(n) * 4,
                        cudaMemcpyHostToDevice, s));
  for (int64_t off = 0; off < n; off += max_chunk_) {
    const int64_t T = std::min(max_chunk_, n - off);
    if (aprec_ == PrefillAPrec::F16) {
      snapshot(sq, false, s);
      KCUDA(cudaMemsetAsync(range_flag_, 0, 4, s));
      chunk(sq, sq.length, T, false, s);
      unsigned flag = 0;
      KCUDA(cudaMemcpyAsync(&flag, range_flag_, 4, cudaMemcpyDeviceToHost, s));
      KCUDA(cudaStreamSynchronize(s));
      if (flag != 0) {
        ++range_redos_;
        // stderr, not spdlog: GCC 13 reports a false -Warray-bounds in fmt 9's float formatting
        // instantiated through spdlog in this file.
        std::fprintf(stderr,
                     "warning: prefill: an activation of tokens %lld..%lld exceeds the fp16 range "
                     "(limit %g); redoing the chunk on the split-bf16 route\n",
                     (long long)sq.length, (long long)(sq.length + T - 1), double(f16_limit_));
        snapshot(sq, true, s);
        chunk(sq, sq.length, T, true, s);
      }
    } else {
      chunk(sq, sq.length, T, true, s);
    }
    if (all_logits)
      this->all_logits(T, logits + off * V, s);
    else if (off + T == n)
      last_logits(T, logits, s);
    sq.length += T;
  }
  PrefillSeqEndArgs e;
  e.len = sq.length;
  e.history = sq.d_history;
  e.len_out = sq.d_len;
  e.pos = sq.d_pos;
  e.token = sq.d_token;
  prefill_seq_end(e, s);
  KCUDA(cudaStreamSynchronize(s));
}

// exact: every GEMM on the Split route (the default, or a chunk being redone).
void PrefillStep::chunk(DSeq& sq, int64_t pos0, int64_t T, bool exact, cudaStream_t s) {
  const PrefillAPrec route = exact ? PrefillAPrec::Split : aprec_;
  const ModelConfig& c = m_.cfg;
  route_ = route;
  moe_.aprec = route;
  moe_.range_flag = range_flag_;
  moe_.f16_limit = f16_limit_;
  moe_.moe_bm = route == PrefillAPrec::F16 ? moe_bm_ : 0;  // Split: its default (64)
  // The Pipe kernel is a Split-route kernel: an F16 chunk runs every GEMM on the Reg kernel.
  kernel_ = prefill_gemm_kernel_for(gemm_choice_, route, T);
  moe_.kernel = kernel_;
  PrefillEmbedArgs em;
  em.T = T;
  em.tokens = sq.d_history + pos0;
  em.embed = m_.embed;
  em.x = buf_.x;
  prefill_embed(em, s);
  for (int l = 0; l < c.num_layers; ++l) {
    const DLayer& d = m_.layers[size_t(l)];
    norm(buf_.x, d.input_norm, T, buf_.hn, nullptr, s);
    if (d.kind == LayerKind::LinearAttention)
      gdn_layer(d, sq, l, T, s);
    else
      attn_layer(d, sq, l, pos0, T, s);
    moe_layer(d, T, s);
  }
}

void PrefillStep::norm(const float* x, const float* w, int64_t T, float* y, uint16_t* y16,
                       cudaStream_t s) {
  const int64_t H = m_.cfg.hidden_size;
  PrefillRmsNormArgs n;
  n.T = T;
  n.n = H;
  n.x = x;
  n.ldx = H;
  n.w = w;
  n.eps = m_.cfg.rms_norm_eps;
  n.y = y;
  n.ldy = H;
  n.y16 = y16;
  n.ldy16 = H;
  prefill_rmsnorm(n, s);
}

// The planes of a split of a [T, K] A for the Pipe kernel (moe_.pipe[0]), or hi = nullptr when no
// GEMM of that width runs on it (the Reg kernel reads the fp32 A).
PipeSplitArgs PrefillStep::split_planes(int64_t T, int64_t K) const {
  PipeSplitArgs sp;
  // (K % 512 != 0: no weight of that width runs on the Pipe kernel; nothing to split.)
  if (kernel_ != PrefillGemmKernel::Pipe || !prefill_pipe_supports(DFmt::Q4, K)) return sp;
  sp.rows = T;
  sp.K = K;
  sp.hi = moe_.pipe[0].hi;
  if (prefill_pipe_q4_mma() != PipeMma::Dq) {  // (Dq: the hi plane only)
    sp.lo = moe_.pipe[0].lo;
    sp.sum = moe_.pipe[0].sum;
  }
  return sp;
}

// The split of fp32 A [T, K] (lda) for the Pipe kernel, or none (Reg kernel).
PipeA PrefillStep::split(const float* a, int64_t lda, int64_t T, int64_t K, cudaStream_t s) {
  PipeSplitArgs sp = split_planes(T, K);
  if (sp.hi == nullptr) return {};
  sp.A = a;
  sp.lda = lda;
  return prefill_pipe_split(sp, s);
}

// C[T, W.rows] (op)= A W^T with fp32 A (rows of lda), on the Pipe kernel when pa is a split of A
// and the kernel takes W's format and width (prefill_pipe_supports), else on the Reg kernel.
void PrefillStep::gemm(const PipeA& pa, const float* a, int64_t lda, int64_t T, const DMat& W,
                       float* c, int64_t ldc, GemmEpi epi, cudaStream_t s) {
  PrefillGemmArgs g;
  g.M = T;
  g.N = W.rows;
  g.K = W.cols;
  if (pa.valid() && prefill_pipe_supports(W.fmt, W.cols)) {
    g.pipe = pa;
  } else {
    g.A = a;
    g.lda = lda;
    g.aprec = route_;
    g.range_flag = range_flag_;
    g.f16_limit = f16_limit_;
  }
  g.W = W;
  g.epi = epi;
  g.C = c;
  g.ldc = ldc;
  prefill_gemm(g, s);
}

void PrefillStep::gdn_layer(const DLayer& d, DSeq& sq, int l, int64_t T, cudaStream_t s) {
  const ModelConfig& c = m_.cfg;
  const int64_t H = c.hidden_size, C = c.gdn_conv_dim(), VD = c.gdn_value_dim();
  const int Hv = c.linear_num_value_heads;
  const PipeA ph = split(buf_.hn, H, T, H, s);
  // One GEMM for q|k|v, z, b, a (rows of P = C + VD + 2 Hv floats).
  const int64_t P = d.in_proj.rows;
  gemm(ph, buf_.hn, H, T, d.in_proj, buf_.proj, P, GemmEpi::Store, s);
  const float* z = buf_.proj + C;
  const float* b = z + VD;
  PrefillConvArgs cv;
  cv.T = T;
  cv.C = C;
  cv.x = buf_.proj;
  cv.ldx = P;
  cv.w = d.conv_w;
  cv.state = sq.conv[size_t(l)];
  cv.u = buf_.u;
  prefill_conv(cv, s);
  PrefillGdnArgs g;
  g.T = T;
  g.u = buf_.u;
  g.ldu = C;
  g.b = b;
  g.a = b + Hv;
  g.ldb = g.lda = P;
  g.A_log = d.A_log;
  g.dt_bias = d.dt_bias;
  g.state = sq.rec[size_t(l)];
  g.o = buf_.o;
  g.scratch = buf_.gdn;
  g.Hk = c.linear_num_key_heads;
  g.Hv = Hv;
  g.dk = c.linear_key_head_dim;
  g.dv = c.linear_value_head_dim;
  prefill_gdn(g, s);
  PrefillGatedNormArgs gn;
  gn.rows = T * Hv;
  gn.n = c.linear_value_head_dim;
  gn.o = buf_.o;
  gn.z = z;
  gn.z_heads = Hv;
  gn.ldz = P;
  gn.w = d.gnorm;
  gn.eps = c.rms_norm_eps;
  // out_proj's A split by the norm itself; fp32 y only where the Reg kernel will read it.
  const PipeSplitArgs sy = split_planes(T, VD);
  const PipeA py = sy.planes();  // (invalid when hi is null: no Pipe GEMM of this width)
  gn.hi = sy.hi;
  gn.lo = sy.lo;
  gn.sum = sy.sum;
  gn.y = py.valid() && prefill_pipe_supports(d.out.fmt, d.out.cols) ? nullptr : buf_.y;
  prefill_gated_norm(gn, s);
  gemm(py, buf_.y, VD, T, d.out, buf_.x, H, GemmEpi::Residual, s);
}

void PrefillStep::attn_layer(const DLayer& d, DSeq& sq, int l, int64_t pos0, int64_t T,
                             cudaStream_t s) {
  const ModelConfig& c = m_.cfg;
  const int64_t H = c.hidden_size, D = c.head_dim;
  const int64_t QG = int64_t(c.num_attention_heads) * 2 * D, KV = int64_t(c.num_kv_heads) * D,
                AO = int64_t(c.num_attention_heads) * D;
  const PipeA ph = split(buf_.hn, H, T, H, s);
  // One GEMM for q|gate, k, v (rows of P = QG + 2 KV floats).
  const int64_t P = d.attn_in.rows;
  gemm(ph, buf_.hn, H, T, d.attn_in, buf_.proj, P, GemmEpi::Store, s);
  PrefillAttnArgs a;
  a.T = T;
  a.pos0 = pos0;
  a.capacity = sq.capacity;
  a.qg = buf_.proj;
  a.k = buf_.proj + QG;
  a.v = buf_.proj + QG + KV;
  a.ld = P;
  a.q_norm = d.q_norm;
  a.k_norm = d.k_norm;
  a.eps = c.rms_norm_eps;
  a.rope_theta = c.rope_theta;
  a.qbuf = buf_.qbuf;
  a.kcache = sq.kc[size_t(l)];
  a.vcache = sq.vc[size_t(l)];
  a.out = buf_.attn;
  a.gated = true;
  a.p_split = attn_p_split_;
  a.qk_wgmma = attn_qk_wgmma_;
  a.pv_wgmma = attn_pv_wgmma_;
  a.wide = attn_wide_;
  a.heads = c.num_attention_heads;
  a.kv_heads = c.num_kv_heads;
  a.head_dim = c.head_dim;
  a.rotary_dim = c.rotary_dim;
  prefill_attn(a, s);
  gemm(split(buf_.attn, AO, T, AO, s), buf_.attn, AO, T, d.o, buf_.x, H, GemmEpi::Residual, s);
}

void PrefillStep::moe_layer(const DLayer& d, int64_t T, cudaStream_t s) {
  const ModelConfig& c = m_.cfg;
  const int64_t H = c.hidden_size;
  norm(buf_.x, d.post_norm, T, buf_.hn, nullptr, s);
  // Router logits in exact fp32 (the decode GEMV's and the CPU's numbers up to summation order;
  // route: KESTREL_ROUTER_GEMM).
  PrefillGemmF32Args r;
  r.route = router_route_;
  r.M = T;
  r.N = c.num_experts;
  r.K = H;
  r.A = buf_.hn;
  r.lda = H;
  r.W = d.router;
  r.C = moe_.logits;
  r.ldc = c.num_experts;
  prefill_gemm_f32(r, s);
  MoePrefillWeights w;
  w.router = d.router;
  w.gate = d.gate;
  w.up = d.up;
  w.down = d.down;
  w.shared_gate = d.sh_gate;
  w.shared_up = d.sh_up;
  w.shared_down = d.sh_down;
  w.shared_expert_gate = d.sh_egate;
  w.E = c.num_experts;
  w.topk = c.num_experts_per_tok;
  w.hidden = H;
  w.I = c.moe_intermediate_size;
  w.Is = c.shared_expert_intermediate_size;
  moe_prefill(w, buf_.hn, T, moe_, buf_.x, /*accumulate=*/true, s);
}

// Logits of the chunk's last row: the decode step's lm_head GEMV (final norm fused in front,
// exact fp32 dots), so a prompt's last logits are the numbers decode computes for that row.
void PrefillStep::last_logits(int64_t T, float* host, cudaStream_t s) {
  const ModelConfig& c = m_.cfg;
  const int64_t H = c.hidden_size;
  GemvArgs g;
  g.M = 1;
  g.K = H;
  g.x = buf_.x + (T - 1) * H;
  g.ldx = H;
  g.pro = Prologue::RmsNorm;
  g.norm_w = m_.final_norm;
  g.eps = c.rms_norm_eps;
  g.seg[0] = GemvSeg{m_.lm_head, Epilogue::Store, buf_.logits, c.vocab_size};
  g.nseg = 1;
  gemv(g, s);
  KCUDA(cudaMemcpyAsync(host, buf_.logits, size_t(c.vocab_size) * 4, cudaMemcpyDeviceToHost, s));
}

// Logits of every row of the chunk: final norm, lm_head on tensor cores in blocks of
// kLogitRows rows, each block copied to the host.
void PrefillStep::all_logits(int64_t T, float* host, cudaStream_t s) {
  const ModelConfig& c = m_.cfg;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  norm(buf_.x, m_.final_norm, T, buf_.hn, nullptr, s);
  route_ = PrefillAPrec::Split;  // after the chunk's range check: the exact route
  // (vocabulary-wide: the Pipe kernel has enough tiles at any row count)
  kernel_ = gemm_choice_ == PrefillGemmChoice::Reg ? PrefillGemmKernel::Reg : PrefillGemmKernel::Pipe;
  for (int64_t r0 = 0; r0 < T; r0 += kLogitRows) {
    const int64_t rows = std::min(kLogitRows, T - r0);
    gemm(split(buf_.hn + r0 * H, H, rows, H, s), buf_.hn + r0 * H, H, rows, m_.lm_head, buf_.logits,
         V, GemmEpi::Store, s);
    KCUDA(cudaMemcpyAsync(host + r0 * V, buf_.logits, size_t(rows * V) * 4, cudaMemcpyDeviceToHost, s));
  }
}

}  // namespace kestrel::cuda
