// Decoding the bit-packed mask operands (jax_flashattn.PackedMask: bits and tile summaries) into
// a PackedMaskView, checked against the attention shapes.
#pragma once

#include <string>

#include "ffi/decode.h"
#include "ffi/decode_mask.h"
#include "jfa/packed_mask.h"
#include "jfa/params.h"
#include "xla/ffi/api/ffi.h"

namespace jfa::ffi_decode {

// bits uint32 [B|1, N|1, T, ceil(S/128)*4] and tiles uint8 [same B|1, N|1, ceil(T/64), ceil(S/128)],
// or two rank-0 placeholders without a mask.
inline ffi::Error decode_packed_mask(const ffi::AnyBuffer& bits, const ffi::AnyBuffer& tiles,
                                     const AttentionParams& p, PackedMaskView* view) {
  if (!present(bits) && !present(tiles)) return ffi::Error::Success();
  auto d = bits.dimensions();
  if (d.size() != 4 || bits.element_type() != ffi::DataType::U32 || (d[0] != 1 && d[0] != p.B) ||
      (d[1] != 1 && d[1] != p.N) || d[2] != p.T || d[3] != mask_words(p.S))
    return invalid("packed mask bits must be uint32 [B or 1, N or 1, T, ceil(S/128)*4] with B=" +
                   std::to_string(p.B) + ", N=" + std::to_string(p.N) + ", T=" + std::to_string(p.T) +
                   ", S=" + std::to_string(p.S) + ", got " + shape_str(d));
  if (auto e = expect(tiles, "packed mask tiles", {d[0], d[1], mask_row_blocks(p.T), mask_chunks(p.S)},
                      ffi::DataType::U8);
      e.failure())
    return e;
  view->bits = static_cast<const uint32_t*>(bits.untyped_data());
  view->tiles = static_cast<const uint8_t*>(tiles.untyped_data());
  view->words = mask_words(p.S);
  view->chunks = mask_chunks(p.S);
  view->row_blocks = mask_row_blocks(p.T);
  view->bits_head_stride = d[1] == 1 ? 0 : p.T * view->words;
  view->bits_batch_stride = d[0] == 1 ? 0 : d[1] * p.T * view->words;
  view->tiles_head_stride = d[1] == 1 ? 0 : view->row_blocks * view->chunks;
  view->tiles_batch_stride = d[0] == 1 ? 0 : d[1] * view->row_blocks * view->chunks;
  return ffi::Error::Success();
}

}  // namespace jfa::ffi_decode
