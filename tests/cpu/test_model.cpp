// Model-level properties of the CPU backend: prefill-then-decode equals one prefill of the whole
// sequence; chunked prompts continue the same state; batches of several sequences; step errors.
#include "core/check.h"
#include "cpu/cpu_backend.h"
#include "engine/engine.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kestrel {
namespace {

double rel(const float* a, const float* b, int64_t n) {
  double md = 0, mr = 1e-30;
  for (int64_t i = 0; i < n; ++i) {
    md = std::max(md, std::abs(double(a[i]) - b[i]));
    mr = std::max(mr, std::abs(double(b[i])));
  }
  return md / mr;
}

std::vector<int32_t> some_tokens(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(int32_t((i * 977 + salt * 131) % 3999));
  return t;
}

TEST(CpuModel, PrefillThenDecodeEqualsFullPrefill) {
  auto be = load_backend(fixtures_dir() / "tiny", {});
  const int64_t V = be->config().vocab_size;
  const auto toks = some_tokens(90, 1);
  // One prefill of all 90 tokens (chunked GDN across a chunk boundary).
  const SeqId a = be->create_sequence(128);
  StepRequest ra{a, toks, true};
  StepResult full;
  be->step({&ra, 1}, {&full, 1});
  // 70-token prefill, then 20 single-token decode steps.
  const SeqId b = be->create_sequence(128);
  StepRequest rb{b, std::span(toks).first(70), true};
  StepResult part;
  be->step({&rb, 1}, {&part, 1});
  for (int64_t t = 0; t < 70; ++t)
    EXPECT_LE(rel(part.logits.data() + t * V, full.logits.data() + t * V, V), 5e-5);
  for (size_t i = 70; i < toks.size(); ++i) {
    StepRequest r{b, std::span(toks).subspan(i, 1), false};
    StepResult o;
    be->step({&r, 1}, {&o, 1});
    EXPECT_LE(rel(o.logits.data(), full.logits.data() + int64_t(i) * V, V), 5e-5) << "token " << i;
  }
  // Chunked prompt processing: 90 tokens as 33 + 57 equals one prefill.
  const SeqId c = be->create_sequence(128);
  StepRequest c1{c, std::span(toks).first(33), false}, c2{c, std::span(toks).subspan(33), false};
  StepResult o1, o2;
  be->step({&c1, 1}, {&o1, 1});
  be->step({&c2, 1}, {&o2, 1});
  EXPECT_LE(rel(o2.logits.data(), full.logits.data() + 89 * V, V), 5e-5);
  EXPECT_EQ(be->sequence_length(c), 90);
}

TEST(CpuModel, BatchOfSequencesEqualsSeparateRuns) {
  auto be = load_backend(fixtures_dir() / "tiny", {});
  const int64_t V = be->config().vocab_size;
  const auto t1 = some_tokens(5, 2), t2 = some_tokens(9, 3);
  const SeqId s1 = be->create_sequence(32), s2 = be->create_sequence(32);
  StepRequest batch[2] = {{s1, t1, false}, {s2, t2, false}};
  StepResult out[2];
  be->step(batch, out);
  const SeqId s3 = be->create_sequence(32);
  StepRequest r3{s3, t2, false};
  StepResult o3;
  be->step({&r3, 1}, {&o3, 1});
  EXPECT_EQ(out[1].logits, o3.logits);
  EXPECT_EQ(int64_t(out[0].logits.size()), V);
}

TEST(CpuModel, StepErrorsLeaveStateUnchanged) {
  auto be = load_backend(fixtures_dir() / "tiny", {});
  const SeqId s = be->create_sequence(8);
  const auto toks = some_tokens(9, 4);
  StepRequest r{s, toks, false};
  StepResult o;
  EXPECT_THROW(be->step({&r, 1}, {&o, 1}), Error);  // over capacity
  EXPECT_EQ(be->sequence_length(s), 0);
  const int32_t bad = 5000;
  StepRequest rb{s, {&bad, 1}, false};
  EXPECT_THROW(be->step({&rb, 1}, {&o, 1}), Error);  // id outside the vocabulary
  StepRequest ru{12345, toks, false};
  EXPECT_THROW(be->step({&ru, 1}, {&o, 1}), Error);  // unknown sequence
  EXPECT_THROW(be->create_sequence(0), Error);
  EXPECT_EQ(be->sequence_length(s), 0);
}

TEST(CpuModel, CudaDeviceIsAnExplicitError) {
#ifndef KESTREL_HAS_CUDA
  BackendOptions o;
  o.device = DeviceKind::Cuda;
  EXPECT_THROW(load_backend(fixtures_dir() / "tiny", o), Error);
#else
  GTEST_SKIP() << "built with CUDA: covered by the GPU tests";
#endif
  EXPECT_THROW(parse_device("tpu"), Error);
}

}  // namespace
}  // namespace kestrel
