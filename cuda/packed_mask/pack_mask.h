// Packing a boolean mask on the GPU: jax_flashattn.pack_mask's CUDA kernels (the layout:
// jfa/packed_mask.h). Host-only: includable from a .cc compiled by a plain C++ compiler.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "jfa/mask_packing.h"

namespace jfa::gpu {

// Enqueues on `stream` the kernels that write bits [slices, T, mask_words(S)] and tiles
// [slices, mask_row_blocks(T), mask_chunks(S)] (device pointers); returns the launch error.
cudaError_t pack_mask(const BooleanMask& mask, uint32_t* bits, uint8_t* tiles, cudaStream_t stream);

}  // namespace jfa::gpu
