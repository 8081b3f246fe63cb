// Paged key/value caches on the CPU: the kernels read K and V as [B, S, K, H] tensors, so a paged
// call's pages are first copied into such buffers (each sequence's pages in table order).
#pragma once

#include <vector>

#include "jfa/params.h"

namespace jfa::cpu {

// Copies the pages p.paged names into `k` and `v` and returns p reading those (contiguous, no
// table). Page ids outside the pool are clamped into it, as on the GPU.
AttentionParams gather_pages(const AttentionParams& p, std::vector<char>* k, std::vector<char>* v);

}  // namespace jfa::cpu
