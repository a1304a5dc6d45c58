// The instruction-set dispatch: the CPU's best path, found once, and a limit tests can lower.
#include <atomic>

#include "common.h"

namespace jaxlm {
namespace {

Isa BestIsa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
      __builtin_cpu_supports("f16c")) {
    return __builtin_cpu_supports("avx512bf16") ? kAvx512Bf16 : kAvx512Vnni;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return kAvx2;
  }
#endif
  return kPortable;
}

std::atomic<int>& Limit() {
  static std::atomic<int> limit{kAvx512Bf16};
  return limit;
}

Isa CpuIsa() {
  static const Isa best = BestIsa();
  return best;
}

}  // namespace

Isa ActiveIsa() {
  return static_cast<Isa>(std::min<int>(CpuIsa(), Limit().load(std::memory_order_relaxed)));
}

}  // namespace jaxlm

extern "C" {

// The best path this CPU runs (a `jaxlm::Isa`).
int JaxlmKernelsBestIsa() { return jaxlm::CpuIsa(); }

// Keeps the kernels at `limit` or below; returns the path they take from now on.
int JaxlmKernelsLimitIsa(int limit) {
  jaxlm::Limit().store(limit);
  return jaxlm::ActiveIsa();
}

}  // extern "C"
