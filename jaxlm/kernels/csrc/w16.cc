// `w @ x` for 16-bit float weights (bfloat16 or float16) and float32 activations of a few
// columns: XLA:CPU streams a bfloat16 product of one or two columns at about a third of the
// machine's read bandwidth (`docs/performance.md`, "16-bit products"). Each weight is widened to
// float32 in registers (on AVX512-BF16, bfloat16 pairs multiply as stored, exactly) and summed in
// float32, as XLA computes the product: only the order of the sums differs.
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace jaxlm {
namespace {

// The most columns the kernel takes: one accumulator each in registers.
constexpr int64_t kMostColumns = 8;

enum class Half { kBf16, kF16 };

template <Half H>
inline float Widen(uint16_t v) {
  if constexpr (H == Half::kBf16) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return HalfToFloat(v);
  }
}

// Row r's products with every column, the tail of the inputs from `k` on, added to `sums`.
template <Half H>
inline void Tail(const uint16_t* w, int64_t in, const float* xt, int64_t cols, int64_t k,
                 float* sums) {
  for (; k < in; ++k) {
    const float wk = Widen<H>(w[k]);
    for (int64_t c = 0; c < cols; ++c) sums[c] += wk * xt[c * in + k];
  }
}

template <Half H>
void RowsPortable(const uint16_t* w, int64_t in, const float* xt, int64_t cols, int64_t r0,
                  int64_t r1, float* out) {
  for (int64_t r = r0; r < r1; ++r) {
    float* sums = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) sums[c] = 0.0f;
    Tail<H>(w + r * in, in, xt, cols, 0, sums);
  }
}

#ifdef JAXLM_X86

// AVX2: eight weights a vector, two vectors a step, so that two sums a column run side by side.
template <Half H>
__attribute__((target("avx2,fma,f16c"))) inline __m256 Widen8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (H == Half::kBf16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  } else {
    return _mm256_cvtph_ps(v);
  }
}

template <Half H, int C>
__attribute__((target("avx2,fma,f16c"))) void RowAvx2(const uint16_t* w, int64_t in,
                                                      const float* xt, float* out) {
  __m256 acc[C][2];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  const int64_t full = in / 16 * 16;
  for (int64_t k = 0; k < full; k += 16) {
    const __m256 w0 = Widen8<H>(w + k), w1 = Widen8<H>(w + k + 8);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      acc[c][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt + c * in + k), acc[c][0]);
      acc[c][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + c * in + k + 8), acc[c][1]);
    }
  }
  float sums[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) sums[c] = Sum8(_mm256_add_ps(acc[c][0], acc[c][1]));
  Tail<H>(w, in, xt, C, full, sums);
  std::memcpy(out, sums, sizeof sums);
}

// AVX512: sixteen weights a vector, two vectors a step.
template <Half H>
__attribute__((target("avx512f,avx512bw,f16c"))) inline __m512 Widen16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (H == Half::kBf16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  } else {
    return _mm512_cvtph_ps(v);
  }
}

template <Half H, int C>
__attribute__((target("avx512f,avx512bw,f16c"))) void RowAvx512(const uint16_t* w, int64_t in,
                                                                const float* xt, float* out) {
  __m512 acc[C][2];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) acc[c][0] = acc[c][1] = _mm512_setzero_ps();
  const int64_t full = in / 32 * 32;
  for (int64_t k = 0; k < full; k += 32) {
    const __m512 w0 = Widen16<H>(w + k), w1 = Widen16<H>(w + k + 16);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      acc[c][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt + c * in + k), acc[c][0]);
      acc[c][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + c * in + k + 16), acc[c][1]);
    }
  }
  float sums[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) sums[c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[c][0], acc[c][1]));
  Tail<H>(w, in, xt, C, full, sums);
  std::memcpy(out, sums, sizeof sums);
}

// AVX512-BF16, bfloat16 weights: `vdpbf16ps` multiplies the weights as stored by the
// activations rounded to bfloat16 (as the product takes them) in pairs, each pair's sum added
// in float32: no widening, which cost the paths above their speed from 4 columns on.
template <int C>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void RowBf16(const uint16_t* w, int64_t in,
                                                                    const uint16_t* xb,
                                                                    float* out) {
  __m512 acc[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  const int64_t full = in / 32 * 32;
  for (int64_t k = 0; k < full; k += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      acc[c] = _mm512_dpbf16_ps(acc[c], wv, (__m512bh)_mm512_loadu_si512(xb + c * in + k));
    }
  }
  float sums[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    sums[c] = _mm512_reduce_add_ps(acc[c]);
    for (int64_t k = full; k < in; ++k) {
      sums[c] += Widen<Half::kBf16>(w[k]) * Widen<Half::kBf16>(xb[c * in + k]);
    }
  }
  std::memcpy(out, sums, sizeof sums);
}

struct Avx2Path {
  template <Half H, int C>
  static void Row(const uint16_t* w, int64_t in, const float* xt, float* out) {
    RowAvx2<H, C>(w, in, xt, out);
  }
};

struct Avx512Path {
  template <Half H, int C>
  static void Row(const uint16_t* w, int64_t in, const float* xt, float* out) {
    RowAvx512<H, C>(w, in, xt, out);
  }
};

// Its activations are bfloat16 (`xt` holds their bits).
struct Bf16Path {
  template <Half H, int C>
  static void Row(const uint16_t* w, int64_t in, const float* xt, float* out) {
    RowBf16<C>(w, in, reinterpret_cast<const uint16_t*>(xt), out);
  }
};

// One row after another: for a few columns, streaming each row whole reads the weights fastest
// (as the int8 kernel found, `docs/performance.md`, "Native products").
template <typename Path, Half H, int C>
void RowsOf(const uint16_t* w, int64_t in, const float* xt, int64_t r0, int64_t r1, float* out) {
  for (int64_t r = r0; r < r1; ++r) Path::template Row<H, C>(w + r * in, in, xt, out + r * C);
}

template <typename Path, Half H>
void RowsVector(const uint16_t* w, int64_t in, const float* xt, int64_t cols, int64_t r0,
                int64_t r1, float* out) {
  switch (cols) {
    case 1:
      return RowsOf<Path, H, 1>(w, in, xt, r0, r1, out);
    case 2:
      return RowsOf<Path, H, 2>(w, in, xt, r0, r1, out);
    case 3:
      return RowsOf<Path, H, 3>(w, in, xt, r0, r1, out);
    case 4:
      return RowsOf<Path, H, 4>(w, in, xt, r0, r1, out);
    case 5:
      return RowsOf<Path, H, 5>(w, in, xt, r0, r1, out);
    case 6:
      return RowsOf<Path, H, 6>(w, in, xt, r0, r1, out);
    case 7:
      return RowsOf<Path, H, 7>(w, in, xt, r0, r1, out);
    default:
      return RowsOf<Path, H, 8>(w, in, xt, r0, r1, out);
  }
}

#endif  // JAXLM_X86

template <Half H>
void Rows(Isa isa, const uint16_t* w, int64_t in, const float* xt, int64_t cols, int64_t r0,
          int64_t r1, float* out) {
#ifdef JAXLM_X86
  if (H == Half::kBf16 && isa >= kAvx512Bf16) {
    return RowsVector<Bf16Path, H>(w, in, xt, cols, r0, r1, out);
  }
  if (isa >= kAvx512Vnni) return RowsVector<Avx512Path, H>(w, in, xt, cols, r0, r1, out);
  if (isa == kAvx2) return RowsVector<Avx2Path, H>(w, in, xt, cols, r0, r1, out);
#endif
  RowsPortable<H>(w, in, xt, cols, r0, r1, out);
}

template <Half H>
void Matmul(ffi::ThreadPool& pool, const uint16_t* w, int64_t rows, int64_t in, const float* x,
            int64_t cols, float* out) {
  // Each column's inputs side by side, as a row's are.
  std::vector<float> xt(cols * in);
  for (int64_t k = 0; k < in; ++k) {
    for (int64_t c = 0; c < cols; ++c) xt[c * in + k] = x[k * cols + c];
  }
  const Isa isa = ActiveIsa();
  // The AVX512-BF16 path takes the activations' bfloat16 bits: `x` holds bfloat16 values.
  std::vector<uint16_t> bits;
  if (H == Half::kBf16 && isa >= kAvx512Bf16) {
    bits.resize(xt.size());
    for (size_t i = 0; i < xt.size(); ++i) {
      uint32_t v;
      std::memcpy(&v, &xt[i], sizeof v);
      bits[i] = static_cast<uint16_t>(v >> 16);
    }
  }
  const float* xs = bits.empty() ? xt.data() : reinterpret_cast<const float*>(bits.data());
  ParallelRows(pool, rows, RowGrain(pool, rows, 1),
               [&](int64_t r0, int64_t r1) { Rows<H>(isa, w, in, xs, cols, r0, r1, out); });
}

ffi::Error W16Matmul(ffi::ThreadPool pool, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> x,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = w.dimensions();
  const auto xdims = x.dimensions();
  if (dims.size() < 2 || xdims.size() != 2 || xdims[0] != dims.back()) {
    return ffi::Error::InvalidArgument("w16_matmul: `w` [..., out, in] and `x` [in, cols]");
  }
  const int64_t in = dims.back(), cols = xdims[1];
  if (cols < 1 || cols > kMostColumns) {
    return ffi::Error::InvalidArgument("w16_matmul: `x` must have from 1 to 8 columns");
  }
  const int64_t rows = static_cast<int64_t>(w.element_count()) / in;
  const auto* data = static_cast<const uint16_t*>(w.untyped_data());
  switch (w.element_type()) {
    case ffi::DataType::BF16:
      Matmul<Half::kBf16>(pool, data, rows, in, x.typed_data(), cols, y->typed_data());
      return ffi::Error::Success();
    case ffi::DataType::F16:
      Matmul<Half::kF16>(pool, data, rows, in, x.typed_data(), cols, y->typed_data());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("w16_matmul: `w` must be bfloat16 or float16");
  }
}

}  // namespace
}  // namespace jaxlm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlmW16Matmul, jaxlm::W16Matmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());
