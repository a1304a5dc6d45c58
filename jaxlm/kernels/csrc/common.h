// Shared by the kernels: the instruction-set dispatch and the split of rows over XLA's threads.
#ifndef JAXLM_KERNELS_COMMON_H_
#define JAXLM_KERNELS_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define JAXLM_X86 1
#endif

namespace jaxlm {

namespace ffi = xla::ffi;

// The paths a kernel has, from the most portable; each CPU runs those up to its best.
// AVX512-BF16 adds to AVX512-VNNI (every CPU with it has both); only the 16-bit product uses it.
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2, kAvx512Bf16 = 3 };

// The path the kernels take: the CPU's best, or a lower one that `JaxlmKernelsLimitIsa` chose
// (tests force each path a machine can run).
Isa ActiveIsa();

inline int64_t RoundUp(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// `std::nearbyint` in the default rounding mode (ties to even) for |v| < 2^22, without a library
// call, so that loops of it vectorize: adding 1.5 * 2^23 leaves no fraction to keep.
// A float, or a vector of them (`attend.cc`'s, lane by lane).
template <typename T>
inline T RoundEven(T v) {
  return (v + 12582912.0f) - 12582912.0f;
}

// |v| as the bits of its float, which order as the magnitudes do: a maximum over them is a loop
// the compiler vectorizes, where `std::fmax` is a library call a value. A NaN compares above
// every value.
inline int32_t MagnitudeBits(float v) {
  int32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits & 0x7fffffff;
}

// The float whose bits `MagnitudeBits` gave.
inline float FromBits(int32_t bits) {
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// The largest |x[i]| of `n` values (a NaN makes its column's step NaN).
inline float AbsMax(const float* x, int64_t n) {
  int32_t top = 0;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, MagnitudeBits(x[i]));
  return FromBits(top);
}

// IEEE half to float, for the portable path (the vector paths convert in hardware).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = exponent == 0x1f ? sign | 0x7f800000u | (mantissa << 13)
                                         : sign | ((exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef JAXLM_X86
// acc += `dpbusd`(u, s) (unsigned by signed bytes, four to each 32-bit lane), in place. Around
// `_mm512_dpbusd_epi32`, GCC 12 moved each accumulator of a tile into another register and back
// on every product, or kept the tile on the stack; the instruction written out keeps them put.
__attribute__((target("avx512f,avx512vnni"))) inline void Dpbusd(__m512i& acc, __m512i u,
                                                                 __m512i s) {
  asm("vpdpbusd %[s], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [s] "v"(s));
}

// Sixteen rows of sixteen 32-bit words (row i in v[i]) transposed in registers: afterwards v[j]
// holds word j of every row, row i in lane i. The kernels' panels are packed this way; a gather
// of the words ran several times slower on AVX512 CPUs without fast gathers (Zen 4).
__attribute__((target("avx512f"))) inline void TransposeWords(__m512i (&v)[16]) {
  // Within each 128-bit lane L, four rows at a time: v[4s + j] then holds word 4L + j of rows
  // 4s..4s+3 in lane L.
#pragma GCC unroll 4
  for (int s = 0; s < 4; ++s) {
    __m512i* q = v + 4 * s;
    const __m512i ab_lo = _mm512_unpacklo_epi32(q[0], q[1]);
    const __m512i ab_hi = _mm512_unpackhi_epi32(q[0], q[1]);
    const __m512i cd_lo = _mm512_unpacklo_epi32(q[2], q[3]);
    const __m512i cd_hi = _mm512_unpackhi_epi32(q[2], q[3]);
    q[0] = _mm512_unpacklo_epi64(ab_lo, cd_lo);
    q[1] = _mm512_unpackhi_epi64(ab_lo, cd_lo);
    q[2] = _mm512_unpacklo_epi64(ab_hi, cd_hi);
    q[3] = _mm512_unpackhi_epi64(ab_hi, cd_hi);
  }
  // Then the lanes across the four sets of rows.
  __m512i t[16];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512i x0 = _mm512_shuffle_i32x4(v[j], v[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i x1 = _mm512_shuffle_i32x4(v[j], v[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i x2 = _mm512_shuffle_i32x4(v[8 + j], v[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i x3 = _mm512_shuffle_i32x4(v[8 + j], v[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
    t[j] = _mm512_shuffle_i32x4(x0, x2, _MM_SHUFFLE(2, 0, 2, 0));
    t[4 + j] = _mm512_shuffle_i32x4(x0, x2, _MM_SHUFFLE(3, 1, 3, 1));
    t[8 + j] = _mm512_shuffle_i32x4(x1, x3, _MM_SHUFFLE(2, 0, 2, 0));
    t[12 + j] = _mm512_shuffle_i32x4(x1, x3, _MM_SHUFFLE(3, 1, 3, 1));
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}

// Row i's `n` bytes at `w + i * stride` for rows [0, rows) (rows <= 16), in v[i]; zeros past them.
__attribute__((target("avx512f,avx512bw"))) inline void LoadRows(const void* w, int64_t stride,
                                                                 int64_t rows, int64_t n,
                                                                 __m512i (&v)[16]) {
  const __mmask64 mask = n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    v[i] = i < rows ? _mm512_maskz_loadu_epi8(mask, static_cast<const char*>(w) + i * stride)
                    : _mm512_setzero_si512();
  }
}

// The sum of a vector's eight floats: its halves, then pairs, then the last two.
__attribute__((target("avx2"))) inline float Sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)));
}
#endif

// Calls `tile(c, std::integral_constant<int, N>{})` for the columns [c, c + N) of [0, count),
// four at a time, then the 3, 2 or 1 left: the kernels' tiles take their count of columns as a
// template argument, so that their accumulators are registers.
template <typename Tile>
void InFours(int64_t count, const Tile& tile) {
  int64_t c = 0;
  for (; c + 4 <= count; c += 4) tile(c, std::integral_constant<int, 4>{});
  switch (count - c) {
    case 3:
      tile(c, std::integral_constant<int, 3>{});
      break;
    case 2:
      tile(c, std::integral_constant<int, 2>{});
      break;
    case 1:
      tile(c, std::integral_constant<int, 1>{});
      break;
  }
}

// Runs `fn(begin, end)` over the rows [0, rows) in chunks of `grain`, taken in turn by the
// calling thread and by tasks on XLA's own pool, one thread per core in all: the caller is the
// first, and one more thread than cores made a 4-bit decode step's products 2x slower on two
// cores. The caller returns once every chunk is done; a task that starts later finds none left
// and touches only the shared counters it owns a share of, so the caller never waits for a pool
// thread that is busy elsewhere.
template <typename Fn>
void ParallelRows(ffi::ThreadPool& pool, int64_t rows, int64_t grain, const Fn& fn) {
  const int64_t chunks = (rows + grain - 1) / grain;
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, chunks - 1);
  if (helpers <= 0) {
    fn(int64_t{0}, rows);
    return;
  }
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [counters, chunks, grain, rows, &fn] {
    for (int64_t c; (c = counters->next.fetch_add(1)) < chunks;) {
      fn(c * grain, std::min(rows, (c + 1) * grain));
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  while (counters->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

// Rows per chunk: about four chunks per thread, so that a slow thread delays little, and a
// multiple of `block`, the rows a vector path takes at once.
inline int64_t RowGrain(ffi::ThreadPool& pool, int64_t rows, int64_t block) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  return std::max(block, RoundUp((rows + 4 * threads - 1) / (4 * threads), block));
}

}  // namespace jaxlm

#endif  // JAXLM_KERNELS_COMMON_H_
