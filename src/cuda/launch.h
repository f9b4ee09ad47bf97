// Raw launch functions (no validation) implemented in the .cu files; only launchers.cpp and the
// .cu files include this. Everyone else calls the validated launchers of kernels.h.
#pragma once
#include "cuda/kernels.h"

namespace kestrel::cuda {

void gemv_init();
void gemv_launch(const GemvArgs& a, int64_t total_rows, cudaStream_t s);
void gdn_decode_launch(const GdnDecodeArgs& a, cudaStream_t s);
void attn_decode_launch(const AttnDecodeArgs& a, cudaStream_t s);
void moe_gate_up_launch(const MoeGateUpArgs& a, cudaStream_t s);
void moe_down_launch(const MoeDownArgs& a, cudaStream_t s);
void moe_experts_launch(const MoeExpertsArgs& a, cudaStream_t s);
void decode_route_launch(const DecodeRouteArgs& a, cudaStream_t s);
int moe_experts_resident(DFmt f);  // blocks of the fused kernel resident at once on the GPU
void step_begin_launch(const StepBeginArgs& a, cudaStream_t s);

}  // namespace kestrel::cuda
