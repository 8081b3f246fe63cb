// A/B timing of the Hopper forward's bit-packed mask kernels across source trees: compiled against
// one ROOT's cuda/ headers per binary by benchmarks/ab_sm90_bwd.sh (AB_SOURCE), which runs the
// binaries in turn; header-only, so a binary is built without a GPU and carried to one.
//   ab_sm90_fwd_masks [ROUNDS [MIN_T [MASK]]]   B·T = 16k, N·H = 2048, T = S of 4k and 16k (those
//                                               >= MIN_T): ROUNDS timed launches after 3 warm-up
//                                               ones, median, of the kernel a call with a boolean
//                                               mask and no other policy takes (the data set's), for
//                                               each mask pattern of ab_sm90_common.h (or MASK
//                                               alone: causal, block50, block10, random50, dense),
//                                               and the plain non-causal kernel without a mask, the
//                                               dense reference. AB_SMALL=1: one small case
//                                               (T = S = 333) per pattern instead, for compute-sanitizer.
// Each line ends with digests of O and the LSE: a change that should keep the results prints the
// baseline's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ab_sm90_common.h"
#include "sm90/fwd_launch.h"

namespace {

using ab::Element;
using ab::MaskPattern;

constexpr const char* kPatternNames[] = {"causal", "block50", "block10", "random50", "dense"};

// One case: `pattern` on the mask kernel, or (pattern < 0) no mask on the plain kernel.
void run_case(int T, int N, int rounds, int pattern) {
  constexpr int H = AB_HDIM;
  const int B = std::max(1, 16384 / T), S = T;
  jfa::AttentionParams p;
  p.B = B; p.T = T; p.S = S; p.N = N; p.K = N; p.H = H; p.Hv = H;
  p.dtype = jfa::DType::kBFloat16;
  p.scale = 1.f / std::sqrt(float(H));
  p.scale_log2 = p.scale * 1.4426950408889634f;
  const size_t n = size_t(B) * T * N * H;
  void* buf[4];  // q k v o
  for (int i = 0; i < 4; ++i) {
    CK(cudaMalloc(&buf[i], n * sizeof(Element)));
    ab::fill_random<<<1024, 256>>>(static_cast<Element*>(buf[i]), n, i + 1);
    CK(cudaGetLastError());
  }
  p.q = buf[0]; p.k = buf[1]; p.v = buf[2]; p.o = buf[3];
  p.q_strides = p.o_strides = p.k_strides = p.v_strides = jfa::packed_strides(T, N, H);
  float* lse;
  CK(cudaMalloc(&lse, size_t(B) * T * N * 4));
  p.lse = lse;
  p.lse_strides = jfa::Strides{int64_t(T) * N, N, 1};
  int32_t* counter;
  CK(cudaMalloc(&counter, 4));
  p.tile_counter = counter;
  uint32_t* bits = nullptr;
  uint8_t* tiles = nullptr;
  if (pattern >= 0) p.mask.packed_mask = ab::packed_mask(MaskPattern(pattern), T, S, &bits, &tiles);
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  auto launch = [&] {
    namespace sm90 = jfa::sm90;
    if (pattern < 0)
      return sm90::detail::launch_fwd<typename sm90::FwdConfig<Element, H, false>::Traits, false, 0>(p, stream);
    constexpr int kDataSet = sm90::kPolicyPositions | sm90::kPolicyData;
    // The tile run_fwd takes for the data set: 128 x 128 at H 64, else the general one.
    if constexpr (H == 64)
      return sm90::detail::launch_fwd<sm90::FwdTraits<Element, 64, 128, 128, 2>, false, kDataSet>(p, stream);
    else
      return sm90::detail::launch_fwd<typename sm90::GeneralFwdConfig<Element, H>::Traits, false, kDataSet>(p, stream);
  };
  const std::vector<float> ms = ab::time_launches(launch, stream, rounds);
  const uint64_t o_digest = ab::digest(p.o, n * sizeof(Element));
  const uint64_t lse_digest = ab::digest(lse, size_t(B) * T * N * 4);
  const double density = pattern < 0 ? 1.0 : ab::mask_density(MaskPattern(pattern));
  const double flops = 4.0 * B * double(T) * S * N * H * density;  // useful FLOPs
  const float median = ms[ms.size() / 2];
  std::printf("ABF root=%s mask=%s H=%d B=%d T=S=%d N=%d | fwd %.3f ms %.1f TFLOP/s (min %.3f max %.3f) "
              "O %016llx LSE %016llx\n",
              AB_ROOT, pattern < 0 ? "none" : kPatternNames[pattern], H, B, T, N, median, flops / median * 1e-9,
              ms.front(), ms.back(), (unsigned long long)o_digest, (unsigned long long)lse_digest);
  std::fflush(stdout);
  for (void* ptr : {buf[0], buf[1], buf[2], buf[3], (void*)lse, (void*)counter, (void*)bits, (void*)tiles})
    CK(cudaFree(ptr));  // a null one (no mask) is no error
  CK(cudaStreamDestroy(stream));
}

}  // namespace

int main(int argc, char** argv) {
  // The arguments as ab_sm90_bwd.sh passes them to either harness.
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 15, min_t = argc > 2 ? std::atoi(argv[2]) : 0;
  const std::string only = argc > 3 ? argv[3] : "";
  std::vector<int> patterns;
  for (int m = 0; m < int(std::size(kPatternNames)); ++m)
    if (only.empty() || only == "plain" || only == kPatternNames[m]) patterns.push_back(m);
  if (std::getenv("AB_SMALL") != nullptr) {
    for (int m : patterns) run_case(333, 2, 1, m);
    return 0;
  }
  for (int T : {4096, 16384}) {
    if (T < min_t) continue;
    for (int m : patterns) run_case(T, 2048 / AB_HDIM, rounds, m);
    run_case(T, 2048 / AB_HDIM, rounds, -1);
  }
  return 0;
}
