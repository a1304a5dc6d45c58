// `w @ x` for 4-bit weights in blocks of 32 along the input, each block with a float16 scale
// `d` and minimum `m` (a weight is `d * q + m`, q in [0, 15]: GGUF's Q4_1, and its Q4_0 with
// `m = -8 d`), and float32 activations, rounded inside to int8 in blocks of 32 with one float32
// step each. Byte i of a block holds element i in its low nibble and element i + 16 in its
// high one, as GGUF stores them; the activations are laid out to match, so the nibbles
// multiply them as they are read.
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define JAXLM_X86 1
#endif

namespace jaxlm {
namespace {

constexpr int64_t kBlock = 32;
// The vector paths read four blocks of nibbles (64 bytes) at a time: a super-block.
constexpr int64_t kSuper = 4;

// The activations of `cols` columns, per super-block of each: 128 int8 values (the four
// blocks' first halves, then their second halves), and 16 lanes of float32 factors, four per
// block: `scale` holds the block's step in each of its four lanes, `offset` the step times the
// block's sum of values in its first lane (0 in the others), which the minimum multiplies.
struct Activations {
  std::vector<int8_t> values;
  std::vector<float> scale;
  std::vector<float> offset;
  int64_t supers;
};

Activations Round(const float* x, int64_t in, int64_t cols) {
  const int64_t blocks = in / kBlock;
  const int64_t supers = (blocks + kSuper - 1) / kSuper;
  Activations a{std::vector<int8_t>(cols * supers * 128, 0),
                std::vector<float>(cols * supers * 16, 0.0f),
                std::vector<float>(cols * supers * 16, 0.0f), supers};
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t b = 0; b < blocks; ++b) {
      float amax = 0.0f;
      for (int64_t e = 0; e < kBlock; ++e) {
        amax = std::fmax(amax, std::fabs(x[(b * kBlock + e) * cols + c]));
      }
      const float step = amax / 127.0f;
      const int64_t super = c * supers + b / kSuper, lane = 4 * (b % kSuper);
      int8_t* values = a.values.data() + super * 128 + 16 * (b % kSuper);
      int32_t sum = 0;
      for (int64_t e = 0; e < kBlock; ++e) {
        const float v = x[(b * kBlock + e) * cols + c];
        const int q = step == 0.0f ? 0 : static_cast<int>(RoundEven(v / step));
        values[(e / 16) * 64 + e % 16] = static_cast<int8_t>(q);
        sum += q;
      }
      for (int i = 0; i < 4; ++i) a.scale[super * 16 + lane + i] = step;
      a.offset[super * 16 + lane] = step * static_cast<float>(sum);
    }
  }
  return a;
}

// One block of a row against one column, in the order the vector paths use per lane.
float BlockPortable(const uint8_t* w, const uint16_t* dm, const Activations& x, int64_t c,
                    int64_t b) {
  const int64_t super = c * x.supers + b / kSuper, lane = 4 * (b % kSuper);
  const int8_t* values = x.values.data() + super * 128 + 16 * (b % kSuper);
  int32_t dot = 0;
  for (int i = 0; i < 16; ++i) {
    dot += (w[i] & 0x0f) * values[i] + (w[i] >> 4) * values[64 + i];
  }
  const float d = HalfToFloat(dm[0]), m = HalfToFloat(dm[1]);
  return static_cast<float>(dot) * (d * x.scale[super * 16 + lane]) +
         m * x.offset[super * 16 + lane];
}

// Blocks [first, blocks) of a row against columns [c0, c0 + n).
void RowPortable(const uint8_t* w, const uint16_t* dm, int64_t first, int64_t blocks,
                 const Activations& x, int64_t c0, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    float acc = 0.0f;
    for (int64_t b = first; b < blocks; ++b) {
      acc += BlockPortable(w + b * 16, dm + 2 * b, x, c0 + j, b);
    }
    out[j] += acc;
  }
}

#ifdef JAXLM_X86

__attribute__((target("avx2"))) inline float Sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)));
}

// AVX2: two blocks (32 bytes of nibbles) at a time, pairs [first, last) of the row; `maddubs`
// multiplies the unsigned nibbles by the signed activations, and pairs of its products stay
// within int16 (2 * 15 * 127). Adds to `out`.
template <int ND>
__attribute__((target("avx2,fma,f16c"))) void RowAvx2(const uint8_t* w, const uint16_t* dm,
                                                      int64_t first, int64_t last,
                                                      const Activations& x, int64_t c0,
                                                      float* out) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i d_lanes = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
  const __m256i m_lanes = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);
  __m256 acc[ND];
  for (int j = 0; j < ND; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t pair = first; pair < last; ++pair) {
    const int64_t s = pair / 2, p = pair % 2;
    const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + pair * 32));
    const __m256i lo = _mm256_and_si256(wv, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
    const __m128 dms = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(dm + pair * 4)));
    const __m256 wide = _mm256_castps128_ps256(dms);
    const __m256 d = _mm256_permutevar8x32_ps(wide, d_lanes);
    const __m256 m = _mm256_permutevar8x32_ps(wide, m_lanes);
    for (int j = 0; j < ND; ++j) {
      const int64_t super = (c0 + j) * x.supers + s;
      const int8_t* values = x.values.data() + super * 128 + p * 32;
      const __m256i xlo = _mm256_loadu_si256((const __m256i*)values);
      const __m256i xhi = _mm256_loadu_si256((const __m256i*)(values + 64));
      const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xlo), ones),
                                           _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xhi), ones));
      const float* scale = x.scale.data() + super * 16 + p * 8;
      const float* offset = x.offset.data() + super * 16 + p * 8;
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_loadu_ps(scale)),
                               acc[j]);
      acc[j] = _mm256_fmadd_ps(m, _mm256_loadu_ps(offset), acc[j]);
    }
  }
  for (int j = 0; j < ND; ++j) out[j] += Sum8(acc[j]);
}

// AVX512-VNNI: four blocks (64 bytes of nibbles) at a time, the row's first `full` super-blocks,
// `dpbusd` multiplying the unsigned nibbles by the signed activations. Adds to `out`.
template <int ND>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma"))) void RowVnni(
    const uint8_t* w, const uint16_t* dm, int64_t full, const Activations& x, int64_t c0,
    float* out) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i d_lanes = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  const __m512i m_lanes = _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7);
  __m512 acc[ND];
  for (int j = 0; j < ND; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < full; ++s) {
    const __m512i wv = _mm512_loadu_si512(w + s * 64);
    const __m512i lo = _mm512_and_si512(wv, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
    const __m256 quad = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dm + s * 8)));
    const __m512 wide = _mm512_castps256_ps512(quad);
    const __m512 d = _mm512_permutexvar_ps(d_lanes, wide);
    const __m512 m = _mm512_permutexvar_ps(m_lanes, wide);
    for (int j = 0; j < ND; ++j) {
      const int64_t super = (c0 + j) * x.supers + s;
      const int8_t* values = x.values.data() + super * 128;
      __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(values));
      dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(values + 64));
      const __m512 scale = _mm512_loadu_ps(x.scale.data() + super * 16);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, scale), acc[j]);
      acc[j] = _mm512_fmadd_ps(m, _mm512_loadu_ps(x.offset.data() + super * 16), acc[j]);
    }
  }
  for (int j = 0; j < ND; ++j) out[j] += _mm512_reduce_add_ps(acc[j]);
}

#endif  // JAXLM_X86

template <int ND>
void RowVector(bool vnni, const uint8_t* w, const uint16_t* dm, int64_t blocks,
               const Activations& x, int64_t c0, float* out) {
  // Whole super-blocks with AVX512-VNNI, the pairs of blocks left (all on AVX2) with AVX2.
  const int64_t full = vnni ? blocks / kSuper : 0;
  if (vnni) RowVnni<ND>(w, dm, full, x, c0, out);
  RowAvx2<ND>(w, dm, 2 * full, blocks / 2, x, c0, out);
}

// Row `w` (`blocks` blocks) against columns [c0, c0 + n), n <= 4, on the path `isa`: the
// vector paths take the blocks in pairs, the portable one the rest.
void Row(Isa isa, const uint8_t* w, const uint16_t* dm, int64_t blocks, const Activations& x,
         int64_t c0, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = 0.0f;
  int64_t done = 0;
#ifdef JAXLM_X86
  if (isa != kPortable) {
    const bool vnni = isa == kAvx512Vnni;
    switch (n) {
      case 4:
        RowVector<4>(vnni, w, dm, blocks, x, c0, out);
        break;
      case 3:
        RowVector<3>(vnni, w, dm, blocks, x, c0, out);
        break;
      case 2:
        RowVector<2>(vnni, w, dm, blocks, x, c0, out);
        break;
      default:
        RowVector<1>(vnni, w, dm, blocks, x, c0, out);
    }
    done = blocks / 2 * 2;
  }
#endif
  RowPortable(w, dm, done, blocks, x, c0, n, out);
}

ffi::Error W4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F16> scales,
                    ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = packed.dimensions();
  const auto xdims = x.dimensions();
  if (dims.size() < 2 || xdims.size() != 2 || xdims[0] % kBlock != 0 ||
      2 * dims.back() != xdims[0]) {
    return ffi::Error::InvalidArgument(
        "w4_matmul: `packed` [..., out, in / 2] and `x` [in, cols], `in` a multiple of 32");
  }
  const int64_t in = xdims[0], cols = xdims[1], blocks = in / kBlock;
  const int64_t rows = static_cast<int64_t>(packed.element_count()) / dims.back();
  if (static_cast<int64_t>(scales.element_count()) != rows * blocks * 2) {
    return ffi::Error::InvalidArgument(
        "w4_matmul: `scales` needs a scale and a minimum per block of 32 of each row");
  }
  const Isa isa = ActiveIsa();
  const Activations a = Round(x.typed_data(), in, cols);
  const uint8_t* w = packed.typed_data();
  const uint16_t* dm = scales.typed_data();
  float* out = y->typed_data();
  ParallelRows(pool, rows, RowGrain(pool, rows, 4), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < cols; c += 4) {
        const int64_t n = std::min<int64_t>(4, cols - c);
        float tile[4];
        Row(isa, w + r * blocks * 16, dm + r * blocks * 2, blocks, a, c, n, tile);
        for (int64_t j = 0; j < n; ++j) out[r * cols + c + j] = tile[j];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxlm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlmW4Matmul, jaxlm::W4Matmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F16>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());
