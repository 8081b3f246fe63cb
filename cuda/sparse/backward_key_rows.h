// The tensor-core backward's second pass (backward_key_rows.cu): dK and dV of the selected rows from
// the P and scale·dS that the first pass (backward_tensor_cores.cu) wrote to ws.weights.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "jfa/sparse_params.h"
#include "sparse/sparse_gpu.h"

namespace jfa::sparse_gpu {

// Whether the pass takes a call whose first pass does: its tiles within max_smem bytes of shared
// memory, its grid within CUDA's limits.
bool key_rows_take(const SparseParams& p, int max_smem);

// Adds dK and dV of items [first_item, first_item + count) (item = (b·T + t)·K + kh; the workspace
// holds their weights from index 0) into ws.dk_accum and ws.dv_accum.
cudaError_t key_row_gradients(const SparseParams& p, const SparseBackwardWorkspace& ws, int64_t first_item,
                              int64_t count, cudaStream_t stream);

}  // namespace jfa::sparse_gpu
