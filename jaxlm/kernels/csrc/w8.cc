// `w @ x` for int8 weights with one float32 scale per row, stored after a rotation of their
// input (`jaxlm.ops.quantize_weight`), and float32 activations, each column of `x` rotated the
// same way and rounded inside to two int8 digits sharing one step (as
// `jaxlm.ops.quantized_matmul` rounds them for XLA's integer dot): the weights are read once
// for both digits, which is the cost of a decode step. The integer sums are exact, so every
// path gives the same bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace jaxlm {
namespace {

// The second digit counts steps this many times finer than the first's.
constexpr float kDigit = 254.0f;

// The activations' digits: `count` vectors of `stride` bytes (the input rounded up to 64), the
// two digits of column c at 2c and 2c + 1, and each vector's sum of digits (`totals`), which
// the AVX512-VNNI path takes back out of its products with the weights offset by 128.
struct Digits {
  std::vector<int8_t> values;
  std::vector<int32_t> totals;
  std::vector<float> steps;
  int64_t stride;
  int count;
};

// Four doubles in GCC's and Clang's vector extension, built for whatever the library targets.
typedef double Double4 __attribute__((vector_size(32)));

// The unnormalized Hadamard transform of 64 values, the butterflies of `Rotate` in its order:
// the first two within each vector of four (a lane's partner brought by a shuffle, its sign by
// a multiplication by +-1, exact), the others between vectors. It vectorizes, where the loop's
// first butterflies pair neighbours.
__attribute__((always_inline)) inline void Hadamard64(double* v) {
  Double4 r[16];
  std::memcpy(r, v, sizeof r);
  const Double4 s1 = {1, -1, 1, -1};
  const Double4 s2 = {1, 1, -1, -1};
  for (Double4& x : r) {
    x = __builtin_shufflevector(x, x, 0, 0, 2, 2) + __builtin_shufflevector(x, x, 1, 1, 3, 3) * s1;
    x = __builtin_shufflevector(x, x, 0, 1, 0, 1) + __builtin_shufflevector(x, x, 2, 3, 2, 3) * s2;
  }
  for (int h = 1; h < 16; h *= 2) {
    for (int i = 0; i < 16; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const Double4 a = r[j], b = r[j + h];
        r[j] = a + b;
        r[j + h] = a - b;
      }
    }
  }
  std::memcpy(v, r, sizeof r);
}

// Column c of `x` [in, cols] rotated into `v`: times `signs`, then an orthonormal Hadamard
// transform of each block of `block` inputs, as butterflies (the tests' NumPy reference takes
// the same steps). In doubles the sums of a block's floats are exact unless their magnitudes
// lie some 30 binary orders apart, so each value comes out as the exact rotation rounded once
// to float, whatever the order of the sums, and so do its digits.
__attribute__((always_inline)) inline void Rotate(const float* x, int64_t in, int64_t cols,
                                                  int64_t c, const float* signs, int64_t block,
                                                  double* sums, float* v) {
  for (int64_t k = 0; k < in; ++k) sums[k] = double{x[k * cols + c]} * signs[k];
  if (block == 64) {
    for (int64_t k = 0; k < in; k += 64) Hadamard64(sums + k);
  } else {
    for (int64_t h = 1; h < block; h *= 2) {
      for (int64_t i = 0; i < in; i += 2 * h) {
        for (int64_t j = i; j < i + h; ++j) {
          const double a = sums[j], b = sums[j + h];
          sums[j] = a + b;
          sums[j + h] = a - b;
        }
      }
    }
  }
  const double root = std::sqrt(static_cast<double>(block));
  for (int64_t k = 0; k < in; ++k) v[k] = static_cast<float>(sums[k] / root);
}

// Column c's digits into `d`, its rotation in `sums` and `rotated` ([in] each).
__attribute__((always_inline)) inline void RoundColumn(const float* x, int64_t in, int64_t cols,
                                                       int64_t c, const float* signs, int64_t block,
                                                       double* sums, float* rotated, Digits& d) {
  Rotate(x, in, cols, c, signs, block, sums, rotated);
  float step = AbsMax(rotated, in) / 127.0f;
  step = step == 0.0f ? 1.0f : step;
  const float finer = kDigit / step;
  int8_t* hi = d.values.data() + 2 * c * d.stride;
  int8_t* lo = hi + d.stride;
  int32_t hi_total = 0, lo_total = 0;
  for (int64_t k = 0; k < in; ++k) {
    const float v = rotated[k];
    const float h = RoundEven(v / step);
    const float l = std::min(127.0f, std::max(-127.0f, RoundEven((v - h * step) * finer)));
    hi[k] = static_cast<int8_t>(h);
    lo[k] = static_cast<int8_t>(l);
    hi_total += hi[k];
    lo_total += lo[k];
  }
  d.totals[2 * c] = hi_total;
  d.totals[2 * c + 1] = lo_total;
  d.steps[c] = step;
}

// `RoundColumn` built for each path's vector width: the same operations, so the same bits, and
// on a decode step's short columns a measurable share of the product's time
// (`docs/performance.md`, "Native products").
#define JAXLM_ROUND_COLUMN(name, attributes)                                                    \
  attributes void name(const float* x, int64_t in, int64_t cols, int64_t c, const float* signs, \
                       int64_t block, double* sums, float* rotated, Digits& d) {                \
    RoundColumn(x, in, cols, c, signs, block, sums, rotated, d);                                \
  }
JAXLM_ROUND_COLUMN(RoundColumnPortable, )
#ifdef JAXLM_X86
JAXLM_ROUND_COLUMN(RoundColumnAvx2, __attribute__((target("avx2"))))
JAXLM_ROUND_COLUMN(RoundColumnAvx512, __attribute__((target("avx512f,avx512bw"))))
#endif

// Every column's digits, the columns split over XLA's threads (a prompt chunk's are many).
Digits Round(ffi::ThreadPool& pool, Isa isa, const float* x, int64_t in, int64_t cols,
             const float* signs, int64_t block) {
  Digits d{std::vector<int8_t>(2 * cols * RoundUp(in, 64), 0), std::vector<int32_t>(2 * cols, 0),
           std::vector<float>(cols), RoundUp(in, 64), static_cast<int>(2 * cols)};
  auto column = RoundColumnPortable;
#ifdef JAXLM_X86
  if (isa >= kAvx512Vnni) column = RoundColumnAvx512;
  if (isa == kAvx2) column = RoundColumnAvx2;
#endif
  ParallelRows(pool, cols, RowGrain(pool, cols, 1), [&](int64_t c0, int64_t c1) {
    std::vector<double> sums(in);
    std::vector<float> rotated(in);
    for (int64_t c = c0; c < c1; ++c)
      column(x, in, cols, c, signs, block, sums.data(), rotated.data(), d);
  });
  return d;
}

// sums[(r - r0) * count + j] = sum_k w[r, k] * digit j [k], for rows [r0, r1).
void SumsPortable(const int8_t* w, int64_t in, const Digits& x, int64_t r0, int64_t r1,
                  int32_t* sums) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int j = 0; j < x.count; ++j) {
      const int8_t* xj = x.values.data() + j * x.stride;
      int32_t s = 0;
      for (int64_t k = 0; k < in; ++k) s += int32_t{w[r * in + k]} * xj[k];
      sums[(r - r0) * x.count + j] = s;
    }
  }
}

#ifdef JAXLM_X86

// AVX2: `maddubs` multiplies unsigned by signed bytes, so each product is taken as |w| times x
// with w's sign (llama.cpp's trick); a pair of products stays within int16 (2 * 128 * 127).
template <int NR, int ND>
__attribute__((target("avx2,fma"))) void TileAvx2(const int8_t* w, int64_t in, const int8_t* x,
                                                  int64_t stride, int32_t* out, int count) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[NR][ND];
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) acc[i][j] = _mm256_setzero_si256();
  const int64_t full = in / 32 * 32;
  for (int64_t k = 0; k < full; k += 32) {
    __m256i xs[ND];
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) xs[j] = _mm256_loadu_si256((const __m256i*)(x + j * stride + k));
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + i * in + k));
      const __m256i magnitude = _mm256_sign_epi8(wv, wv);
#pragma GCC unroll 4
      for (int j = 0; j < ND; ++j) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xs[j], wv));
        acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < ND; ++j) {
      const __m128i half =
          _mm_add_epi32(_mm256_castsi256_si128(acc[i][j]), _mm256_extracti128_si256(acc[i][j], 1));
      const __m128i quad = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
      int32_t s = _mm_cvtsi128_si32(_mm_add_epi32(quad, _mm_shuffle_epi32(quad, 0xb1)));
      for (int64_t k = full; k < in; ++k) s += int32_t{w[i * in + k]} * x[j * stride + k];
      out[i * count + j] = s;
    }
  }
}

// AVX512-VNNI: `dpbusd` multiplies unsigned by signed bytes: the weights, offset by 128 to
// unsigned bytes (a flip of their top bit), by the signed digits; 128 times each digit
// vector's sum (`totals`) takes the offset back out. One step takes 64 inputs of NR rows; the
// last part of a row is read through a mask, whose lanes past its end meet zero digits. The
// loops are unrolled so that the accumulators stay in registers: as arrays, GCC kept them on
// the stack, a store for every product, and the kernel ran at half its speed.
template <int NR, int ND>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void StepVnni(
    const int8_t* w, int64_t in, const int8_t* x, int64_t stride, int64_t k, __mmask64 mask,
    __m512i (&acc)[NR][ND]) {
  const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i xs[ND];
#pragma GCC unroll 4
  for (int j = 0; j < ND; ++j) xs[j] = _mm512_loadu_si512(x + j * stride + k);
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i) {
    const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + i * in + k), top);
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) Dpbusd(acc[i][j], wv, xs[j]);
  }
}

template <int NR, int ND>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void TileVnni(const int8_t* w, int64_t in,
                                                                     const int8_t* x,
                                                                     int64_t stride,
                                                                     const int32_t* totals,
                                                                     int32_t* out, int count) {
  __m512i acc[NR][ND];
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) acc[i][j] = _mm512_setzero_si512();
  const int64_t full = in / 64 * 64;
  for (int64_t k = 0; k < full; k += 64) {
    StepVnni<NR, ND>(w, in, x, stride, k, ~__mmask64{0}, acc);
  }
  if (full < in) {
    const __mmask64 tail = (__mmask64{1} << (in - full)) - 1;
    StepVnni<NR, ND>(w, in, x, stride, full, tail, acc);
  }
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) {
      out[i * count + j] = _mm512_reduce_add_epi32(acc[i][j]) - 128 * totals[j];
    }
}

struct Avx2Path {
  // Two rows of four digit vectors fill AVX2's 16 registers with accumulators and digits.
  static constexpr int kMostRows = 2;
  template <int NR, int ND>
  static void Tile(const int8_t* w, int64_t in, const int8_t* x, int64_t stride, const int32_t*,
                   int32_t* out, int count) {
    TileAvx2<NR, ND>(w, in, x, stride, out, count);
  }
};

struct VnniPath {
  static constexpr int kMostRows = 4;
  template <int NR, int ND>
  static void Tile(const int8_t* w, int64_t in, const int8_t* x, int64_t stride,
                   const int32_t* totals, int32_t* out, int count) {
    TileVnni<NR, ND>(w, in, x, stride, totals, out, count);
  }
};

// Every digit vector against NR rows, four at a time (as many accumulators as registers allow).
template <typename Path, int NR>
void TileRows(const int8_t* w, int64_t in, const Digits& x, int32_t* out) {
  InFours(x.count, [&](int64_t j, auto nd) {
    Path::template Tile<NR, decltype(nd)::value>(w, in, x.values.data() + j * x.stride, x.stride,
                                                 x.totals.data() + j, out + j, x.count);
  });
}

// Rows [r0, r1), NR at a time.
template <typename Path, int NR>
void SumsTiles(const int8_t* w, int64_t in, const Digits& x, int64_t r0, int64_t r1,
               int32_t* sums) {
  int64_t r = r0;
  for (; r + NR <= r1; r += NR) TileRows<Path, NR>(w + r * in, in, x, sums + (r - r0) * x.count);
  for (; r < r1; ++r) TileRows<Path, 1>(w + r * in, in, x, sums + (r - r0) * x.count);
}

// The rows a tile takes: several share each load of the digits, which pays for many columns,
// but a tile reads its rows side by side, and for one or two columns (decode) reading one row
// after another streams the weights faster (`docs/performance.md`, "Native products").
template <typename Path>
void SumsVector(const int8_t* w, int64_t in, const Digits& x, int64_t r0, int64_t r1,
                int32_t* sums) {
  if (x.count <= 4) return SumsTiles<Path, 1>(w, in, x, r0, r1, sums);
  if (x.count <= 16) return SumsTiles<Path, 2>(w, in, x, r0, r1, sums);
  SumsTiles<Path, Path::kMostRows>(w, in, x, r0, r1, sums);
}

// Many columns (a prompt chunk), AVX512-VNNI: 16 rows at a time packed as `dpbusd` takes them
// (four inputs of each row side by side, the 16 rows across a vector, offset by 128), against
// each digit vector's four inputs broadcast. Every product adds into its own row's lane, so
// nothing sums across a vector, and the rows' offsets are paid once, not once per tile of
// digits (`docs/performance.md`, "Native products").
constexpr int kPanel = 16;

// The columns from which the panels, which pay for their packing, run.
constexpr int64_t kPanelColumns = 24;

// Rows [0, rows) (rows <= 16) of `w` [rows, in] into `panel`: inputs 4g..4g+3 at 64 * g, each
// 64 inputs of the rows transposed in registers (`TransposeWords`). Inputs past `in` meet zero
// digits and rows past `rows` are never stored, so both may hold any byte.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void PackPanel(const int8_t* w, int64_t in,
                                                                      int64_t rows,
                                                                      uint8_t* panel) {
  const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t groups = (in + 3) / 4;
  for (int64_t k = 0; k < in; k += 64) {
    __m512i v[16];
    LoadRows(w + k, in, rows, in - k, v);
    TransposeWords(v);
    const int64_t first = k / 4, count = std::min<int64_t>(16, groups - first);
    for (int64_t g = 0; g < count; ++g) {
      _mm512_storeu_si512(panel + 64 * (first + g), _mm512_xor_si512(v[g], top));
    }
  }
}

// NP panels of `groups` groups against the digit vectors [j0, j0 + ND) (ND even, so that a
// column's two digits meet in one tile), rescaled as `W8Matmul` rescales the rows' sums, into
// `out` [rows][cols].
template <int NP, int ND>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void PanelTile(
    const uint8_t* panels, int64_t groups, const Digits& x, int64_t j0, const float* scale,
    int64_t rows, int64_t cols, float* out) {
  __m512i acc[NP][ND];
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 12
    for (int j = 0; j < ND; ++j) acc[p][j] = _mm512_setzero_si512();
  const int8_t* digits = x.values.data() + j0 * x.stride;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i wv[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_si512(panels + (p * groups + g) * 64);
#pragma GCC unroll 12
    for (int j = 0; j < ND; ++j) {
      int32_t word;
      std::memcpy(&word, digits + j * x.stride + 4 * g, sizeof word);
      const __m512i xs = _mm512_set1_epi32(word);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) Dpbusd(acc[p][j], wv[p], xs);
    }
  }
  alignas(64) float lanes[kPanel];
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p) {
    const int64_t live = std::min<int64_t>(kPanel, rows - p * kPanel);
    const __m512 s =
        _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << live) - 1), scale + p * kPanel);
#pragma GCC unroll 12
    for (int j = 0; j < ND; j += 2) {
      const int64_t c = (j0 + j) / 2;
      const float step = x.steps[c];
      const __m512 hi = _mm512_cvtepi32_ps(
          _mm512_sub_epi32(acc[p][j], _mm512_set1_epi32(128 * x.totals[j0 + j])));
      const __m512 lo = _mm512_cvtepi32_ps(
          _mm512_sub_epi32(acc[p][j + 1], _mm512_set1_epi32(128 * x.totals[j0 + j + 1])));
      const __m512 v = _mm512_add_ps(_mm512_mul_ps(hi, _mm512_set1_ps(step)),
                                     _mm512_mul_ps(lo, _mm512_set1_ps(step / kDigit)));
      _mm512_store_ps(lanes, _mm512_mul_ps(v, s));
      for (int64_t i = 0; i < live; ++i) out[(p * kPanel + i) * cols + c] = lanes[i];
    }
  }
}

// NP panels against every digit vector, eight at a time (four columns).
template <int NP>
void PanelColumns(const uint8_t* panels, int64_t groups, const Digits& x, const float* scale,
                  int64_t rows, int64_t cols, float* out) {
  int64_t j = 0;
  for (; j + 8 <= x.count; j += 8) PanelTile<NP, 8>(panels, groups, x, j, scale, rows, cols, out);
  switch (x.count - j) {
    case 6:
      PanelTile<NP, 6>(panels, groups, x, j, scale, rows, cols, out);
      break;
    case 4:
      PanelTile<NP, 4>(panels, groups, x, j, scale, rows, cols, out);
      break;
    case 2:
      PanelTile<NP, 2>(panels, groups, x, j, scale, rows, cols, out);
      break;
  }
}

// Rows [r0, r1) of `w` against every column, two panels packed at a time while they stay in
// the cache, into `out` [rows][cols].
void PanelRows(const int8_t* w, int64_t in, const Digits& x, const float* scale, int64_t r0,
               int64_t r1, int64_t cols, float* out) {
  const int64_t groups = (in + 3) / 4;
  std::vector<uint8_t> panels(2 * groups * 64);
  for (int64_t r = r0; r < r1; r += 2 * kPanel) {
    const int64_t n = std::min<int64_t>(2 * kPanel, r1 - r);
    PackPanel(w + r * in, in, std::min<int64_t>(kPanel, n), panels.data());
    if (n > kPanel) {
      PackPanel(w + (r + kPanel) * in, in, n - kPanel, panels.data() + groups * 64);
      PanelColumns<2>(panels.data(), groups, x, scale + r, n, cols, out + r * cols);
    } else {
      PanelColumns<1>(panels.data(), groups, x, scale + r, n, cols, out + r * cols);
    }
  }
}

#endif  // JAXLM_X86

void Sums(Isa isa, const int8_t* w, int64_t in, const Digits& x, int64_t r0, int64_t r1,
          int32_t* sums) {
#ifdef JAXLM_X86
  if (isa >= kAvx512Vnni) return SumsVector<VnniPath>(w, in, x, r0, r1, sums);
  if (isa == kAvx2) return SumsVector<Avx2Path>(w, in, x, r0, r1, sums);
#endif
  SumsPortable(w, in, x, r0, r1, sums);
}

ffi::Error W8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                    ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> signs, int64_t block,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = q.dimensions();
  const auto xdims = x.dimensions();
  if (dims.size() < 2 || xdims.size() != 2 || xdims[0] != dims.back()) {
    return ffi::Error::InvalidArgument("w8_matmul: `q` [..., out, in] and `x` [in, cols]");
  }
  const int64_t in = dims.back(), cols = xdims[1];
  const int64_t rows = static_cast<int64_t>(scale.element_count());
  if (rows * in != static_cast<int64_t>(q.element_count())) {
    return ffi::Error::InvalidArgument("w8_matmul: `scale` needs one value per row of `q`");
  }
  if (static_cast<int64_t>(signs.element_count()) != in || block < 1 || in % block != 0 ||
      (block & (block - 1)) != 0) {
    return ffi::Error::InvalidArgument(
        "w8_matmul: `signs` needs one value per input, `block` a power of two dividing them");
  }
  const Isa isa = ActiveIsa();
  const Digits digits = Round(pool, isa, x.typed_data(), in, cols, signs.typed_data(), block);
  const int8_t* w = q.typed_data();
  const float* s = scale.typed_data();
  float* out = y->typed_data();
#ifdef JAXLM_X86
  if (isa >= kAvx512Vnni && cols >= kPanelColumns) {
    ParallelRows(pool, rows, RowGrain(pool, rows, 2 * kPanel),
                 [&](int64_t r0, int64_t r1) { PanelRows(w, in, digits, s, r0, r1, cols, out); });
    return ffi::Error::Success();
  }
#endif
  ParallelRows(pool, rows, RowGrain(pool, rows, 4), [&](int64_t r0, int64_t r1) {
    std::vector<int32_t> sums((r1 - r0) * digits.count);
    Sums(isa, w, in, digits, r0, r1, sums.data());
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t* rs = sums.data() + (r - r0) * digits.count;
      for (int64_t c = 0; c < cols; ++c) {
        const float step = digits.steps[c];
        const float v = static_cast<float>(rs[2 * c]) * step +
                        static_cast<float>(rs[2 * c + 1]) * (step / kDigit);
        out[r * cols + c] = v * s[r];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxlm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlmW8Matmul, jaxlm::W8Matmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S8>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("block")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());
