// Rows of a table gathered where the table lies, for any element type: XLA:CPU gathers 16-bit
// float rows from a float32 copy of the whole table (`jaxlm.kernels.rows`).
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace jaxlm {

namespace ffi = xla::ffi;

// `out[i] = table[ids[i]]`, as `jnp.take` gathers: a negative id counts from the end, and a row
// of an id outside the table is all ones (NaN for floats).
ffi::Error Rows(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = table.dimensions();
  if (dims.size() != 2) {
    return ffi::Error::InvalidArgument("`table` must be [rows, features]");
  }
  const int64_t count = dims[0];
  const size_t row_bytes = ffi::ByteWidth(table.element_type()) * dims[1];
  const auto* from = static_cast<const uint8_t*>(table.untyped_data());
  auto* to = static_cast<uint8_t*>(out->untyped_data());
  const int32_t* index = ids.typed_data();
  for (size_t i = 0; i < ids.element_count(); ++i) {
    int64_t row = index[i];
    if (row < 0) row += count;
    uint8_t* dest = to + i * row_bytes;
    if (row >= 0 && row < count) {
      std::memcpy(dest, from + row * row_bytes, row_bytes);
    } else {
      std::memset(dest, 0xff, row_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace jaxlm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlmRows, jaxlm::Rows,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>());
