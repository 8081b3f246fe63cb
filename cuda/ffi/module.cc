// The nanobind module: hands the FFI handlers to Python as capsules and says what was built.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ffi/handlers.h"
#ifdef JFA_WITH_CUDA
#include "sm80/api.h"
#endif

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule as_capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an XLA FFI handler must have type XLA_FFI_Error*(XLA_FFI_CallFrame*)");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_flashattn, m) {
  m.doc() = "jax_flashattn's compiled kernels as XLA FFI handlers";

  m.def("cpu_targets", []() {
    nb::dict d;
#define JFA_CPU_TARGET(target, stem) d[target] = as_capsule(stem##Cpu);
    JFA_HANDLERS(JFA_CPU_TARGET)
    return d;
  });

  m.def("cuda_targets", []() {
    nb::dict d;
#ifdef JFA_WITH_CUDA
#define JFA_CUDA_TARGET(target, stem) d[target] = as_capsule(stem##Cuda);
    JFA_HANDLERS(JFA_CUDA_TARGET)
#endif
    return d;
  });

  m.def("cuda_variants", []() -> std::string {
#ifdef JFA_WITH_CUDA
    return jfa::sm80::built_variants();
#else
    return "";
#endif
  });

  m.def("cuda_head_dim", [](int head_dim) -> int {
#ifdef JFA_WITH_CUDA
    return jfa::sm80::round_up_head_dim(head_dim);
#else
    (void)head_dim;
    return -1;
#endif
  }, "Smallest head dim built for the CUDA kernels that is >= head_dim, or -1.");

  m.def("cuda_accum_cols", [](int head_dim) -> int {
#ifdef JFA_WITH_CUDA
    return int(jfa::cuda_accum_cols(head_dim));
#else
    return head_dim;
#endif
  }, "Columns of a row of the CUDA backward's float32 workspace for (padded) head dim head_dim.");

  m.def("cuda_paged_page_rows", [](int head_dim) -> int {
#ifdef JFA_WITH_CUDA
    return int(jfa::cuda_paged_page_rows(head_dim));
#else
    (void)head_dim;
    return 0;
#endif
  }, "Page sizes (multiples of it) read in place by the Hopper forward at head_dim, or 0.");

  m.def("cuda_sparse_backward_tensor_cores",
        [](const std::string& dtype, int64_t N, int64_t K, int64_t H, int64_t Hv, int64_t topk,
           bool shares_values) -> bool {
#ifdef JFA_WITH_CUDA
          if (dtype != "float16" && dtype != "bfloat16") return false;
          const jfa::DType t = dtype == "float16" ? jfa::DType::kFloat16 : jfa::DType::kBFloat16;
          return jfa::cuda_sparse_backward_tensor_cores(t, N, K, H, Hv, topk, shares_values);
#else
          (void)dtype, (void)N, (void)K, (void)H, (void)Hv, (void)topk, (void)shares_values;
          return false;
#endif
        },
        "Whether the sparse backward's tensor-core kernels take a deterministic=False call on the "
        "current device (dtype name, query heads N, key heads K, head dims H and Hv, topk, V = K[..., :Hv]).");
}
