// Backend selection. --device cuda needs a build with KESTREL_CUDA=ON; otherwise it is an error
// (never a silent fallback to the CPU).
#include "engine/engine.h"

#include "core/check.h"
#include "cpu/cpu_backend.h"

#if defined(KESTREL_HAS_CUDA) && __has_include("cuda/cuda_backend.h")
#include "cuda/cuda_backend.h"
#define KESTREL_CUDA_BACKEND 1
#endif

namespace kestrel {

DeviceKind parse_device(const std::string& s) {
  if (s == "cpu") return DeviceKind::Cpu;
  if (s == "cuda") return DeviceKind::Cuda;
  KESTREL_FAIL("unknown device '{}' (expected cpu or cuda)", s);
}

std::unique_ptr<Backend> load_backend(const std::filesystem::path& model_dir,
                                      const BackendOptions& opts) {
  if (opts.device == DeviceKind::Cuda) {
#ifdef KESTREL_CUDA_BACKEND
    return make_cuda_backend(load_weights(model_dir, opts.load), opts);
#else
    KESTREL_FAIL("--device cuda: this kestrel was built without the CUDA backend "
                 "(configure with -DKESTREL_CUDA=ON on a machine with nvcc)");
#endif
  }
  return std::make_unique<cpu::CpuBackend>(load_weights(model_dir, opts.load), opts.threads);
}

}  // namespace kestrel
