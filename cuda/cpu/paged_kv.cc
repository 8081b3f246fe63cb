#include "paged_kv.h"

#include <cstring>

#include "jfa/mask.h"

namespace jfa::cpu {
namespace {

// One pool's pages, page by page (a page's rows of every head are contiguous in both layouts),
// rows past each sequence's length zeroed: they may hold anything (NaN too), and the kernels
// multiply their zero probabilities by them.
void gather(const AttentionParams& p, const void* pool, const Strides& pool_strides, int64_t dim,
            int64_t element, std::vector<char>* out) {
  const PagedKV& paged = p.paged;
  const int64_t row_bytes = p.K * dim * element, page_bytes = paged.page_size * row_bytes;
  out->assign(size_t(p.B * paged.table_stride * page_bytes), 0);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t length = clamp_length(p.mask.kv_lengths, b, p.S);
    for (int64_t entry = 0; entry * paged.page_size < length; ++entry) {
      const int64_t rows = min_i64(paged.page_size, length - entry * paged.page_size);
      std::memcpy(out->data() + (b * paged.table_stride + entry) * page_bytes,
                  static_cast<const char*>(pool) + paged.page(b, entry * paged.page_size) * pool_strides.batch * element,
                  size_t(rows * row_bytes));
    }
  }
}

}  // namespace

AttentionParams gather_pages(const AttentionParams& p, std::vector<char>* k, std::vector<char>* v) {
  const int64_t element = p.dtype == DType::kFloat32 ? 4 : 2;
  gather(p, p.k, p.k_strides, p.H, element, k);
  gather(p, p.v, p.v_strides, p.Hv, element, v);
  AttentionParams out = p;
  out.paged = PagedKV{};
  out.k = k->data();
  out.v = v->data();
  out.k_strides = packed_strides(p.S, p.K, p.H);
  out.v_strides = packed_strides(p.S, p.K, p.Hv);
  return out;
}

}  // namespace jfa::cpu
