// Decoding the pack-mask call's buffers (jax_flashattn.pack_mask), shared by its CPU and CUDA
// handlers: a boolean mask [Bm, Nm, T|1, S|1] in, bits and tile summaries out (jfa/packed_mask.h).
#pragma once

#include <cstdint>
#include <string>

#include "ffi/decode.h"
#include "jfa/mask_packing.h"
#include "xla/ffi/api/ffi.h"

namespace jfa::ffi_decode {

struct PackMaskCall {
  BooleanMask mask;
  uint32_t* bits = nullptr;
  uint8_t* tiles = nullptr;
};

// q_len, kv_len: T and S of the packed mask (the boolean mask may broadcast either to them).
inline ffi::Error decode_pack_mask(const ffi::AnyBuffer& mask, ffi::AnyBuffer bits, ffi::AnyBuffer tiles,
                                   int64_t q_len, int64_t kv_len, PackMaskCall* call) {
  auto d = mask.dimensions();
  if (q_len < 0 || kv_len < 0)
    return invalid("pack_mask: q_len and kv_len must be >= 0, got " + std::to_string(q_len) + ", " +
                   std::to_string(kv_len));
  if (d.size() != 4 || mask.element_type() != ffi::DataType::PRED || (d[2] != 1 && d[2] != q_len) ||
      (d[3] != 1 && d[3] != kv_len))
    return invalid("pack_mask: mask must be bool of rank 4 [Bm, Nm, T or 1, S or 1] with T=" +
                   std::to_string(q_len) + ", S=" + std::to_string(kv_len) + ", got " + shape_str(d));
  if (auto e = expect(bits, "packed mask bits", {d[0], d[1], q_len, mask_words(kv_len)}, ffi::DataType::U32);
      e.failure())
    return e;
  if (auto e = expect(tiles, "packed mask tiles", {d[0], d[1], mask_row_blocks(q_len), mask_chunks(kv_len)},
                      ffi::DataType::U8);
      e.failure())
    return e;
  BooleanMask& m = call->mask;
  m.data = static_cast<const uint8_t*>(mask.untyped_data());
  m.slices = d[0] * d[1];
  m.T = q_len;
  m.S = kv_len;
  m.slice_stride = d[2] * d[3];
  m.row_stride = d[2] == 1 ? 0 : d[3];
  m.key_stride = d[3] == 1 ? 0 : 1;
  call->bits = static_cast<uint32_t*>(bits.untyped_data());
  call->tiles = static_cast<uint8_t*>(tiles.untyped_data());
  return ffi::Error::Success();
}

}  // namespace jfa::ffi_decode
