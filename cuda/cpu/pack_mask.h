// Packing a boolean mask on the CPU: jax_flashattn.pack_mask's kernel (the layout: jfa/packed_mask.h).
#pragma once

#include <cstdint>

#include "jfa/mask_packing.h"

namespace jfa::cpu {

// Writes bits [slices, T, mask_words(S)] and tiles [slices, mask_row_blocks(T), mask_chunks(S)].
void pack_mask(const BooleanMask& mask, uint32_t* bits, uint8_t* tiles);

}  // namespace jfa::cpu
