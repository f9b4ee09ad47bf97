// Token-side kernels of the prompt step: the embedding gather for T tokens (BF16 or affine Q4/Q8
// rows dequantised exactly, as the decode step's step_begin and Mat::row_f32), and the device
// counters a sequence holds after its prompt (the state the decode step continues from).
#include "cuda/common.cuh"
#include "cuda/prefill_ops.h"

namespace kestrel::cuda {
namespace {

__device__ __forceinline__ float embed_at(const DMat& e, int64_t row, int64_t k) {
  if (e.fmt == DFmt::BF16)
    return bf16_bits_to_f32(static_cast<const uint16_t*>(e.data)[row * e.cols + k]);
  const int bits = e.fmt == DFmt::Q4 ? 4 : 8;
  const int per = 32 / bits;
  const uint32_t wd = static_cast<const uint32_t*>(e.data)[row * (e.cols / per) + k / per];
  const uint32_t q = (wd >> (bits * (k % per))) & ((1u << bits) - 1u);
  const int64_t g = row * (e.cols / e.group) + k / e.group;
  return bf16_bits_to_f32(e.scales[g]) * float(q) + bf16_bits_to_f32(e.biases[g]);
}

// One block per token.
__global__ void __launch_bounds__(256) embed_kernel(const PrefillEmbedArgs a) {
  const int64_t t = blockIdx.x;
  const int64_t row = a.tokens[t];
  float* x = a.x + t * a.embed.cols;
  for (int64_t k = threadIdx.x; k < a.embed.cols; k += blockDim.x) x[k] = embed_at(a.embed, row, k);
}

__global__ void seq_end_kernel(const PrefillSeqEndArgs a) {
  *a.len_out = int(a.len);
  *a.pos = int(a.len - 1);
  *a.token = a.history[a.len - 1];
}

}  // namespace

void prefill_embed_launch(const PrefillEmbedArgs& a, cudaStream_t s) {
  embed_kernel<<<unsigned(a.T), 256, 0, s>>>(a);
  KCUDA_LAUNCH("prefill_embed");
}

void prefill_seq_end_launch(const PrefillSeqEndArgs& a, cudaStream_t s) {
  seq_end_kernel<<<1, 1, 0, s>>>(a);
  KCUDA_LAUNCH("prefill_seq_end");
}

}  // namespace kestrel::cuda
