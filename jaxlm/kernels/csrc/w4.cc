// `w @ x` for 4-bit weights in blocks of 32 along the input, each block with a float16 scale
// `d` and minimum `m` (a weight is `d * q + m`, q in [0, 15]: GGUF's Q4_1, and its Q4_0 with
// `m = -8 d`), and float32 activations, rounded inside to int8 in blocks of 32 with one float32
// step each. Byte i of a block holds element i in its low nibble and element i + 16 in its
// high one, as GGUF stores them; the activations are laid out to match, so the nibbles
// multiply them as they are read.
// A row takes the columns four at a time (two rows together on the AVX512-VNNI path); from
// `kPanelColumns` columns on (a prompt chunk), that path multiplies panels of 16 rows instead
// (`RowsPanels`).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace jaxlm {
namespace {

constexpr int64_t kBlock = 32;
// The vector paths read four blocks of nibbles (64 bytes) at a time: a super-block.
constexpr int64_t kSuper = 4;
// From this many columns on, the AVX512-VNNI path multiplies panels of rows (`RowsPanels`), whose
// packing costs more than it saves on fewer columns.
constexpr int64_t kPanelColumns = 24;
// Columns rounded by one thread at least: a few are rounded in less time than a thread takes
// to start.
constexpr int64_t kRoundColumns = 16;

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

// Columns [c0, c1) rounded into `a`, a block of all of them at a time, reading `x` along its
// rows: a column's inputs lie `cols` apart, and a prompt chunk's columns read one by one took
// a large share of its products.
void RoundColumns(const float* x, int64_t in, int64_t cols, int64_t c0, int64_t c1,
                  Activations& a) {
  const int64_t blocks = in / kBlock, supers = a.supers, n = c1 - c0;
  std::vector<int32_t> top(n), sum(n);
  std::vector<float> divisor(n);
  for (int64_t b = 0; b < blocks; ++b) {
    // Each column's largest |x| in the block, compared as bits (`AbsMax`).
    std::fill(top.begin(), top.end(), 0);
    for (int64_t e = 0; e < kBlock; ++e) {
      const float* row = x + (b * kBlock + e) * cols + c0;
      for (int64_t j = 0; j < n; ++j) top[j] = std::max(top[j], MagnitudeBits(row[j]));
    }
    // Column j's four lanes of the block in `scale` and `offset`.
    const auto lanes = [&](int64_t j) {
      return ((c0 + j) * supers + b / kSuper) * 16 + 4 * (b % kSuper);
    };
    for (int64_t j = 0; j < n; ++j) {
      const float step = FromBits(top[j]) / 127.0f;
      // A block of zeros has no step; dividing its zeros by one keeps the loop free of branches.
      divisor[j] = step == 0.0f ? 1.0f : step;
      for (int i = 0; i < 4; ++i) a.scale[lanes(j) + i] = step;
    }
    std::fill(sum.begin(), sum.end(), 0);
    for (int64_t e = 0; e < kBlock; ++e) {
      const float* row = x + (b * kBlock + e) * cols + c0;
      int8_t* values = a.values.data() + (c0 * supers + b / kSuper) * 128 + 64 * (e / 16) +
                       16 * (b % kSuper) + e % 16;
      for (int64_t j = 0; j < n; ++j) {
        const int q = static_cast<int>(RoundEven(row[j] / divisor[j]));
        values[j * supers * 128] = static_cast<int8_t>(q);
        sum[j] += q;
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      a.offset[lanes(j)] = a.scale[lanes(j)] * static_cast<float>(sum[j]);
    }
  }
}

// Every column's activations, the columns split over XLA's threads.
Activations Round(ffi::ThreadPool& pool, const float* x, int64_t in, int64_t cols) {
  const int64_t supers = (in / kBlock + kSuper - 1) / kSuper;
  Activations a{std::vector<int8_t>(cols * supers * 128, 0),
                std::vector<float>(cols * supers * 16, 0.0f),
                std::vector<float>(cols * supers * 16, 0.0f), supers};
  ParallelRows(pool, cols, RowGrain(pool, cols, kRoundColumns),
               [&](int64_t c0, int64_t c1) { RoundColumns(x, in, cols, c0, c1, a); });
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

// AVX2: two blocks (32 bytes of nibbles) at a time, the row's first `pairs` pairs; `maddubs`
// multiplies the unsigned nibbles by the signed activations, and pairs of its products stay
// within int16 (2 * 15 * 127). Adds to `out`.
template <int ND>
__attribute__((target("avx2,fma,f16c"))) void RowAvx2(const uint8_t* w, const uint16_t* dm,
                                                      int64_t pairs, const Activations& x,
                                                      int64_t c0, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i d_lanes = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
  const __m256i m_lanes = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);
  __m256 acc[ND];
  for (int j = 0; j < ND; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t pair = 0; pair < pairs; ++pair) {
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

// AVX512-VNNI: super-block `s` (64 bytes of nibbles) of NR rows, `stride` blocks apart, against
// columns [c0, c0 + ND), `dpbusd` multiplying the unsigned nibbles by the signed activations,
// added to `acc`; the nibbles and the blocks' scales read under the masks `bytes` and `halves`.
// The rows share each column's loads.
template <int NR, int ND>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"))) inline void SuperVnni(
    const uint8_t* w, const uint16_t* dm, int64_t stride, int64_t s, __mmask64 bytes,
    __mmask8 halves, const Activations& x, int64_t c0, __m512 (&acc)[NR][ND]) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i d_lanes = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  const __m512i m_lanes = _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7);
  __m512i lo[NR], hi[NR];
  __m512 d[NR], m[NR];
#pragma GCC unroll 2
  for (int i = 0; i < NR; ++i) {
    const __m512i wv = _mm512_maskz_loadu_epi8(bytes, w + i * stride * 16 + s * 64);
    lo[i] = _mm512_and_si512(wv, low);
    hi[i] = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
    const __m256 quad = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(halves, dm + i * stride * 2 + s * 8));
    const __m512 wide = _mm512_castps256_ps512(quad);
    d[i] = _mm512_permutexvar_ps(d_lanes, wide);
    m[i] = _mm512_permutexvar_ps(m_lanes, wide);
  }
#pragma GCC unroll 4
  for (int j = 0; j < ND; ++j) {
    const int64_t at = (c0 + j) * x.supers + s;
    const int8_t* values = x.values.data() + at * 128;
    const __m512i first = _mm512_loadu_si512(values), second = _mm512_loadu_si512(values + 64);
    const __m512 scale = _mm512_loadu_ps(x.scale.data() + at * 16);
    const __m512 offset = _mm512_loadu_ps(x.offset.data() + at * 16);
#pragma GCC unroll 2
    for (int i = 0; i < NR; ++i) {
      __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], first);
      dot = _mm512_dpbusd_epi32(dot, hi[i], second);
      acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d[i], scale), acc[i][j]);
      acc[i][j] = _mm512_fmadd_ps(m[i], offset, acc[i][j]);
    }
  }
}

// NR rows against columns [c0, c0 + ND), into `out` [rows][cols] from the first row's, a
// super-block at a time. Only a row's last super-block is read under a mask (where its blocks
// do not fill it; the activations past them are zeros): masks on every read made the loop
// 1.6-2.2x slower (`docs/performance.md`).
template <int NR, int ND>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"))) void TileVnni(
    const uint8_t* w, const uint16_t* dm, int64_t blocks, const Activations& x, int64_t c0,
    int64_t cols, float* out) {
  const int64_t supers = x.supers, tail = blocks - kSuper * (supers - 1);
  __m512 acc[NR][ND];
#pragma GCC unroll 2
  for (int i = 0; i < NR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  for (int64_t s = 0; s + 1 < supers; ++s) {
    SuperVnni<NR, ND>(w, dm, blocks, s, ~__mmask64{0}, __mmask8{0xff}, x, c0, acc);
  }
  const __mmask64 bytes = tail == kSuper ? ~__mmask64{0} : (__mmask64{1} << (16 * tail)) - 1;
  const auto halves = static_cast<__mmask8>((1u << (2 * tail)) - 1);
  SuperVnni<NR, ND>(w, dm, blocks, supers - 1, bytes, halves, x, c0, acc);
#pragma GCC unroll 2
  for (int i = 0; i < NR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) out[i * cols + c0 + j] = _mm512_reduce_add_ps(acc[i][j]);
  }
}

// NR rows from `w` against every column, four at a time, on the AVX512-VNNI path, into `out`
// [rows][cols] from the first row's.
template <int NR>
void TilesVnni(const uint8_t* w, const uint16_t* dm, int64_t blocks, const Activations& x,
               int64_t cols, float* out) {
  InFours(cols, [&](int64_t c, auto nd) {
    TileVnni<NR, decltype(nd)::value>(w, dm, blocks, x, c, cols, out);
  });
}

// Rows [0, rows) against every column on the AVX512-VNNI path, into `out` [rows][cols]: two
// rows at a time against all of the columns before the next two, while their weights are in
// the cache (four rows at a time spill the accumulators).
void RowsVnni(const uint8_t* w, const uint16_t* dm, int64_t blocks, int64_t rows,
              const Activations& x, int64_t cols, float* out) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    TilesVnni<2>(w + r * blocks * 16, dm + r * blocks * 2, blocks, x, cols, out + r * cols);
  }
  if (r < rows) {
    TilesVnni<1>(w + r * blocks * 16, dm + r * blocks * 2, blocks, x, cols, out + r * cols);
  }
}

// Many columns (a prompt chunk), AVX512-VNNI: 16 rows at a time, their nibbles unpacked once
// to bytes laid out as `dpbusd` takes them (four inputs of each row side by side, the 16 rows
// across a vector), with each block's scales and minimums as 16 float32 lanes, multiply each
// column's four activations broadcast. Every product adds into its own row's lane: nothing sums
// across a vector, which `RowsVnni` does once per row and column.
constexpr int kPanel = 16;

// A panel's bytes: block b's group g of four inputs at 64 * (8b + g); its scales and minimums:
// block b's at 16 * b.
struct Panel {
  uint8_t* values;
  float* d;
  float* m;
};

// The panel of rows [0, rows) (rows <= 16) of `blocks` blocks each, four blocks' nibbles and
// sixteen blocks' scales of the rows at a time transposed in registers (`TransposeWords`); rows
// past `rows` hold 0.
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) void PackPanel(
    const uint8_t* w, const uint16_t* dm, int64_t blocks, int64_t rows, Panel panel) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512i v[16];
  for (int64_t b0 = 0; b0 < blocks; b0 += 4) {
    // Word 4i + g of four blocks' 64 bytes is block b0 + i's inputs 4g..4g+3 in its low
    // nibbles and 16 + 4g.. in its high ones.
    LoadRows(w + 16 * b0, 16 * blocks, rows, 16 * (blocks - b0), v);
    TransposeWords(v);
    for (int64_t b = b0; b < std::min(blocks, b0 + 4); ++b) {
      for (int g = 0; g < 4; ++g) {
        const __m512i words = v[4 * (b - b0) + g];
        _mm512_storeu_si512(panel.values + 64 * (8 * b + g), _mm512_and_si512(words, low));
        _mm512_storeu_si512(panel.values + 64 * (8 * b + 4 + g),
                            _mm512_and_si512(_mm512_srli_epi16(words, 4), low));
      }
    }
  }
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    // The scale and the minimum of a block are one 32-bit word.
    LoadRows(dm + 2 * b0, 4 * blocks, rows, 4 * (blocks - b0), v);
    TransposeWords(v);
    for (int64_t b = b0; b < std::min(blocks, b0 + 16); ++b) {
      const __m512i pairs = v[b - b0];
      _mm512_storeu_ps(panel.d + 16 * b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs)));
      _mm512_storeu_ps(panel.m + 16 * b,
                       _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16))));
    }
  }
}

// NP panels (32 rows at most) against columns [c0, c0 + ND), into `out` [rows][cols].
template <int NP, int ND>
__attribute__((target("avx512f,avx512bw,avx512vnni,fma"))) void PanelTile(
    const Panel* panels, int64_t blocks, int64_t rows, const Activations& x, int64_t c0,
    int64_t cols, float* out) {
  __m512 acc[NP][ND];
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) acc[p][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t slot = 16 * (b % kSuper);
    const int8_t* values[ND];
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) {
      values[j] = x.values.data() + ((c0 + j) * x.supers + b / kSuper) * 128 + slot;
    }
    __m512i dot[NP][ND];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
      for (int j = 0; j < ND; ++j) dot[p][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      // Inputs 4g..4g+3 of the block: the first half's at 4g, the second's 64 bytes on.
      const int64_t at = g < 4 ? 4 * g : 64 + 4 * (g - 4);
      __m512i xs[ND];
#pragma GCC unroll 4
      for (int j = 0; j < ND; ++j) {
        int32_t word;
        std::memcpy(&word, values[j] + at, sizeof word);
        xs[j] = _mm512_set1_epi32(word);
      }
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        const __m512i wv = _mm512_loadu_si512(panels[p].values + 64 * (8 * b + g));
#pragma GCC unroll 4
        for (int j = 0; j < ND; ++j) dot[p][j] = _mm512_dpbusd_epi32(dot[p][j], wv, xs[j]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < ND; ++j) {
      const int64_t factors = ((c0 + j) * x.supers + b / kSuper) * 16 + 4 * (b % kSuper);
      const __m512 step = _mm512_set1_ps(x.scale[factors]);
      const __m512 offset = _mm512_set1_ps(x.offset[factors]);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        const __m512 d = _mm512_loadu_ps(panels[p].d + 16 * b);
        const __m512 m = _mm512_loadu_ps(panels[p].m + 16 * b);
        acc[p][j] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[p][j]), _mm512_mul_ps(d, step), acc[p][j]);
        acc[p][j] = _mm512_fmadd_ps(m, offset, acc[p][j]);
      }
    }
  }
  alignas(64) float lanes[kPanel];
  for (int p = 0; p < NP; ++p) {
    for (int j = 0; j < ND; ++j) {
      _mm512_store_ps(lanes, acc[p][j]);
      for (int64_t i = 0; i < std::min<int64_t>(kPanel, rows - p * kPanel); ++i) {
        out[(p * kPanel + i) * cols + c0 + j] = lanes[i];
      }
    }
  }
}

template <int NP>
void PanelColumns(const Panel* panels, int64_t blocks, int64_t rows, const Activations& x,
                  int64_t cols, float* out) {
  InFours(cols, [&](int64_t c, auto nd) {
    PanelTile<NP, decltype(nd)::value>(panels, blocks, rows, x, c, cols, out);
  });
}

// `rows` rows of `w` against every column, into `out` [rows][cols].
void RowsPanels(const uint8_t* w, const uint16_t* dm, int64_t blocks, const Activations& x,
                int64_t cols, int64_t rows, float* out) {
  const int64_t count = (rows + kPanel - 1) / kPanel;
  std::vector<uint8_t> values(count * blocks * 8 * 64);
  std::vector<float> factors(count * blocks * 2 * kPanel);
  std::vector<Panel> panels(count);
  for (int64_t p = 0; p < count; ++p) {
    const int64_t r = p * kPanel;
    panels[p] = {values.data() + p * blocks * 8 * 64, factors.data() + 2 * p * blocks * kPanel,
                 factors.data() + (2 * p + 1) * blocks * kPanel};
    PackPanel(w + r * blocks * 16, dm + r * blocks * 2, blocks, std::min<int64_t>(kPanel, rows - r),
              panels[p]);
  }
  int64_t p = 0;
  for (; p + 2 <= count; p += 2) {
    PanelColumns<2>(panels.data() + p, blocks, std::min<int64_t>(2 * kPanel, rows - p * kPanel), x,
                    cols, out + p * kPanel * cols);
  }
  if (p < count) {
    PanelColumns<1>(panels.data() + p, blocks, rows - p * kPanel, x, cols, out + p * kPanel * cols);
  }
}

#endif  // JAXLM_X86

// Row `w` (`blocks` blocks) against columns [c0, c0 + ND), on the path `isa` below
// AVX512-VNNI: the AVX2 path takes the blocks in pairs, the portable one the rest.
template <int ND>
void Row(Isa isa, const uint8_t* w, const uint16_t* dm, int64_t blocks, const Activations& x,
         int64_t c0, float* out) {
  for (int64_t j = 0; j < ND; ++j) out[j] = 0.0f;
  int64_t done = 0;
#ifdef JAXLM_X86
  if (isa != kPortable) {
    RowAvx2<ND>(w, dm, blocks / 2, x, c0, out);
    done = blocks / 2 * 2;
  }
#endif
  RowPortable(w, dm, done, blocks, x, c0, ND, out);
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
  const Activations a = Round(pool, x.typed_data(), in, cols);
  const uint8_t* w = packed.typed_data();
  const uint16_t* dm = scales.typed_data();
  float* out = y->typed_data();
#ifdef JAXLM_X86
  if (isa >= kAvx512Vnni && cols >= kPanelColumns) {
    ParallelRows(pool, rows, RowGrain(pool, rows, 2 * kPanel), [&](int64_t r0, int64_t r1) {
      RowsPanels(w + r0 * blocks * 16, dm + r0 * blocks * 2, blocks, a, cols, r1 - r0,
                 out + r0 * cols);
    });
    return ffi::Error::Success();
  }
#endif
  ParallelRows(pool, rows, RowGrain(pool, rows, 4), [&](int64_t r0, int64_t r1) {
#ifdef JAXLM_X86
    if (isa >= kAvx512Vnni) {
      RowsVnni(w + r0 * blocks * 16, dm + r0 * blocks * 2, blocks, r1 - r0, a, cols,
               out + r0 * cols);
      return;
    }
#endif
    for (int64_t r = r0; r < r1; ++r) {
      InFours(cols, [&](int64_t c, auto nd) {
        Row<decltype(nd)::value>(isa, w + r * blocks * 16, dm + r * blocks * 2, blocks, a, c,
                                 out + r * cols + c);
      });
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
