// Attention of a few queries per row (a decode token, or a token and its drafts) over the KV
// cache's pages where they lie: XLA gathers each row's pages into a copy and runs the scores, the
// softmax and the weighted sum as a dozen small operations, each a thunk of its own, in every
// layer (`jaxlm.kernels.attend`). Every query is computed alone, in one order, on every path:
// a drafted chunk's outputs equal decoding's bit for bit.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"

namespace jaxlm {
namespace {

// Sixteen floats, and sixteen int32: GCC lowers their operations to each path's instructions
// (four SSE vectors, two AVX2 ones or one AVX512 one), lane by lane, so every path computes the
// same values in the same order.
typedef float F16x __attribute__((vector_size(64)));
typedef int32_t I16x __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
// Queries, or blocks of features, a loop takes at once.
constexpr int kTile = 4;

__attribute__((always_inline)) inline F16x Load(const float* p) {
  F16x v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Lanes [0, n) from `p`, zeros after: a row's last block, where `n` < 16.
__attribute__((always_inline)) inline F16x LoadPart(const float* p, int64_t n) {
  F16x v = {};
  std::memcpy(&v, p, n * sizeof(float));
  return v;
}

// `n` lanes of a full block (n = 16) or of a row's last one, as `Load` or `LoadPart` read them.
__attribute__((always_inline)) inline F16x LoadLanes(const float* p, int64_t n) {
  return n == kLanes ? Load(p) : LoadPart(p, n);
}

// The first `n` lanes of `v` to `p`: one vector store for a full block.
__attribute__((always_inline)) inline void Store(float* p, F16x v, int64_t n) {
  if (n == kLanes) {
    std::memcpy(p, &v, sizeof v);
  } else {
    std::memcpy(p, &v, n * sizeof(float));
  }
}

__attribute__((always_inline)) inline float Max(F16x v) {
  float top = v[0];
  for (int i = 1; i < kLanes; ++i) top = std::max(top, v[i]);
  return top;
}

__attribute__((always_inline)) inline float Sum(F16x v) {
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// `exp(x)` for x <= 0 to within two units in the last place, lane by lane (Cephes' `expf`:
// `2^k exp(r)`, |r| <= ln(2) / 2), where a library call a value would not vectorize.
__attribute__((always_inline)) inline F16x Exp(F16x x) {
  x = x < -87.0f ? F16x{} - 87.0f : x;
  const F16x k = RoundEven(x * 1.44269504088896341f);
  const F16x r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  F16x p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I16x bits = (__builtin_convertvector(k, I16x) + 127) << 23;
  return p * __builtin_bit_cast(F16x, bits);
}

// The pages, as float32 or as bfloat16's bits (`jaxlm.ops.storage_dtype`).
struct Pages {
  const void* data;
  bool half;

  // The `n` values from element `at` on, as float32: where they lie, or widened into `buffer`.
  __attribute__((always_inline)) inline const float* Read(int64_t at, int64_t n,
                                                          float* buffer) const {
    if (!half) return static_cast<const float*>(data) + at;
    const uint16_t* bits = static_cast<const uint16_t*>(data) + at;
    for (int64_t i = 0; i < n; ++i) {
      buffer[i] = FromBits(static_cast<int32_t>(static_cast<uint32_t>(bits[i]) << 16));
    }
    return buffer;
  }
};

struct Shapes {
  int64_t heads, dim, rows, width;  // q [heads, dim, rows, width]
  int64_t kv, size, per_row;        // pages [*, kv, dim, size] and [*, kv, size, dim]; table
  int64_t num_pages;
  float scale;
};

// Row `b`'s queries of KV head `h` against its pages, into `out` [heads * dim, rows, width].
// A block of 16 slots' scores, or of 16 features' sums, stays in a register while the other
// dimension streams past. Inlined into each path's function, which compiles it for that path.
__attribute__((always_inline)) inline void Head(const Shapes& s, const float* q, const Pages& k,
                                                const Pages& v, const int32_t* table,
                                                const uint8_t* mask, int64_t b, int64_t h,
                                                float* out) {
  const int64_t group = s.heads / s.kv, queries = group * s.width, d = s.dim, n = s.size;
  const int64_t slots = s.per_row * n, padded = RoundUp(slots, kLanes);
  // The queries padded to whole tiles, with zeros.
  std::vector<float> query(RoundUp(queries, kTile) * d), scores(RoundUp(queries, kTile) * padded);
  std::vector<float> buffer(k.half ? d * n : 0), seen(s.width * padded);
  std::vector<int64_t> pages;
  // Query (g, t) of the group, as [queries, dim].
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t e = 0; e < d; ++e) {
      const float* from = q + (((h * group + g) * d + e) * s.rows + b) * s.width;
      for (int64_t t = 0; t < s.width; ++t) query[(g * s.width + t) * d + e] = from[t];
    }
  }
  // The mask as 1s and 0s, and the pages some query sees.
  const uint8_t* row_mask = mask + b * s.width * slots;
  for (int64_t t = 0; t < s.width; ++t) {
    for (int64_t j = 0; j < slots; ++j) seen[t * padded + j] = row_mask[t * slots + j] ? 1 : 0;
  }
  for (int64_t p = 0; p < s.per_row; ++p) {
    bool any = false;
    for (int64_t t = 0; t < s.width; ++t) {
      for (int64_t j = p * n; j < (p + 1) * n; ++j) any |= seen[t * padded + j] != 0.0f;
    }
    const int64_t id = table[b * s.per_row + p];
    if (any && id >= 0 && id < s.num_pages) pages.push_back(p);
  }
  for (const int64_t p : pages) {
    const int64_t id = table[b * s.per_row + p];
    const float* key = k.Read((id * s.kv + h) * d * n, d * n, buffer.data());
    // Four queries at a time share each block of keys (and add in four chains, not one).
    for (int64_t i = 0; i < queries; i += kTile) {
      const float* qi = query.data() + i * d;
      for (int64_t j = 0; j < n; j += kLanes) {
        const int64_t lanes = std::min(kLanes, n - j);
        F16x acc[kTile] = {};
        for (int64_t e = 0; e < d; ++e) {
          const F16x x = LoadLanes(key + e * n + j, lanes);
          for (int r = 0; r < kTile; ++r) acc[r] += qi[r * d + e] * x;
        }
        for (int r = 0; r < kTile && i + r < queries; ++r) {
          Store(scores.data() + (i + r) * padded + p * n + j, acc[r] * s.scale, lanes);
        }
      }
    }
  }
  // Each query's softmax over every slot it sees, as weights in place of its scores.
  const F16x none = F16x{} - std::numeric_limits<float>::infinity();
  std::vector<float> totals(queries);
  for (int64_t i = 0; i < queries; ++i) {
    const float* keep = seen.data() + (i % s.width) * padded;
    float* score = scores.data() + i * padded;
    F16x top = none;
    for (const int64_t p : pages) {
      for (int64_t j = p * n; j < (p + 1) * n; j += kLanes) {
        const int64_t lanes = std::min(kLanes, (p + 1) * n - j);
        const F16x x = LoadLanes(score + j, lanes);
        top = LoadLanes(keep + j, lanes) > 0.0f && x > top ? x : top;
      }
    }
    const float most = Max(top);
    F16x total = {};
    for (const int64_t p : pages) {
      for (int64_t j = p * n; j < (p + 1) * n; j += kLanes) {
        const int64_t lanes = std::min(kLanes, (p + 1) * n - j);
        const F16x x = LoadLanes(score + j, lanes) - most;
        const F16x e = Exp(x < 0.0f ? x : F16x{}) * LoadLanes(keep + j, lanes);
        Store(score + j, e, lanes);
        total += e;
      }
    }
    totals[i] = Sum(total);
    for (const int64_t p : pages) {
      for (int64_t j = p * n; j < (p + 1) * n; ++j) score[j] /= totals[i];
    }
  }
  // The values weighted page by page: four queries at a time share each row of values, read
  // once per page, in blocks of up to 64 features.
  const int64_t width = RoundUp(d, kTile * kLanes);
  std::vector<float> sums(RoundUp(queries, kTile) * width);
  for (const int64_t p : pages) {
    const int64_t id = table[b * s.per_row + p];
    const float* value = v.Read((id * s.kv + h) * n * d, n * d, buffer.data());
    for (int64_t i = 0; i < queries; i += kTile) {
      for (int64_t e = 0; e < d; e += kTile * kLanes) {
        F16x acc[kTile][kTile] = {};
        for (int64_t j = 0; j < n; ++j) {
          F16x x[kTile];
          for (int r = 0; r < kTile; ++r) {
            const int64_t lanes = std::min(kLanes, d - e - r * kLanes);
            x[r] = lanes > 0 ? LoadLanes(value + j * d + e + r * kLanes, lanes) : F16x{};
          }
          for (int u = 0; u < kTile; ++u) {
            const float w = scores[(i + u) * padded + p * n + j];
            for (int r = 0; r < kTile; ++r) acc[u][r] += w * x[r];
          }
        }
        for (int u = 0; u < kTile; ++u) {
          for (int r = 0; r < kTile; ++r) {
            float* to = sums.data() + (i + u) * width + e + r * kLanes;
            Store(to, Load(to) + acc[u][r], kLanes);
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t t = i % s.width, head = h * group + i / s.width;
    for (int64_t e = 0; e < d; ++e) {
      out[((head * d + e) * s.rows + b) * s.width + t] =
          totals[i] > 0.0f ? sums[i * width + e] : 0.0f;
    }
  }
}

#ifdef JAXLM_X86
__attribute__((target("avx512f,avx512bw,avx512vl"))) void HeadAvx512(
    const Shapes& s, const float* q, const Pages& k, const Pages& v, const int32_t* table,
    const uint8_t* mask, int64_t b, int64_t h, float* out) {
  Head(s, q, k, v, table, mask, b, h, out);
}

__attribute__((target("avx2"))) void HeadAvx2(const Shapes& s, const float* q, const Pages& k,
                                              const Pages& v, const int32_t* table,
                                              const uint8_t* mask, int64_t b, int64_t h,
                                              float* out) {
  Head(s, q, k, v, table, mask, b, h, out);
}
#endif

// Work below this many multiply-adds runs on the calling thread alone: handing it to another
// costs more than it takes.
constexpr int64_t kThreadedWork = int64_t{1} << 20;

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                  ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> table, ffi::AnyBuffer mask,
                  ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = table.dimensions();
  const auto vd = v_pages.dimensions();
  const auto type = k_pages.element_type();
  const bool typed = (type == ffi::DataType::F32 || type == ffi::DataType::U16) &&
                     v_pages.element_type() == type && mask.element_type() == ffi::DataType::PRED;
  if (!typed || qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 || kd[1] < 1 ||
      kd[2] != qd[1] || qd[0] % kd[1] != 0 || td[0] != qd[2] || vd[0] != kd[0] || vd[1] != kd[1] ||
      vd[2] != kd[3] || vd[3] != kd[2] ||
      static_cast<int64_t>(mask.element_count()) != qd[2] * qd[3] * td[1] * kd[3]) {
    return ffi::Error::InvalidArgument(
        "attend: `q` [heads, dim, rows, width], `k_pages` [pages, kv, dim, size] and `v_pages` "
        "of float32 or uint16, `table` [rows, per_row], `mask` bool [rows, width, per_row * "
        "size]");
  }
  const Shapes s{qd[0], qd[1], qd[2], qd[3], kd[1], kd[3], td[1], kd[0], scale};
  const bool half = type == ffi::DataType::U16;
  const Pages k{k_pages.untyped_data(), half}, v{v_pages.untyped_data(), half};
  const auto* m = static_cast<const uint8_t*>(mask.untyped_data());
  const Isa isa = ActiveIsa();
  const auto run = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / s.kv, h = i % s.kv;
      const int32_t* t = table.typed_data();
      float* o = out->typed_data();
#ifdef JAXLM_X86
      if (isa >= kAvx512Vnni) {
        HeadAvx512(s, q.typed_data(), k, v, t, m, b, h, o);
        continue;
      }
      if (isa == kAvx2) {
        HeadAvx2(s, q.typed_data(), k, v, t, m, b, h, o);
        continue;
      }
#endif
      Head(s, q.typed_data(), k, v, t, m, b, h, o);
    }
  };
  const int64_t items = s.rows * s.kv;
  const int64_t work = items * (s.heads / s.kv) * s.width * s.per_row * s.size * s.dim * 2;
  if (work < kThreadedWork) {
    run(0, items);
  } else {
    ParallelRows(pool, items, 1, run);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxlm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlmAttend, jaxlm::Attend,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("scale"));
