// A/B timing of the Hopper backward across source trees: compiled against one ROOT's cuda/
// headers per binary by benchmarks/ab_sm90_bwd.sh, which runs the binaries in turn. The launcher
// is header-only, so a binary needs no built library and can be compiled on a machine without a
// GPU, then carried to one.
//   ab_sm90_bwd [ROUNDS [MIN_T [MODE]]]   each case of kCases with T >= MIN_T: ROUNDS timed
//                                         launches (after 3 warm-up ones), median. MODE: plain
//                                         (default; the kernels without masks), dropout (rate 0.1,
//                                         the general path's dropout kernel; needs -DAB_DROPOUT) or
//                                         det (deterministic=True: ordered dQ adds), or a bit-packed
//                                         mask [1, 1, T, S] shared by every batch element and head on
//                                         the cases without causality and GQA (the mask kernels):
//                                         causal (the causal triangle as a mask), block50 or block10
//                                         (half or a tenth of the 128 x 128 blocks, at random:
//                                         runs of empty steps) or random50 (every element at
//                                         random: every tile partial). AB_SMALL=1: one
//                                         small case (T = S = 333) instead, for compute-sanitizer
// AB_DIGEST=1 prints digests of dK, dV and dQ after each case (a tree's change that should keep the
// results: the same digests as the baseline's).
// Inputs: random Q, K, V, O and dO, LSE from a sm90-free estimate (log S + 8), so that P and dS stay
// finite; the figures are for comparing trees, not for quoting against peers (bench_attention.py).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include "ab_sm90_common.h"
#include "sm90/bwd_launch.h"

namespace {

using ab::Element;
using ab::fill_random;
using Config = jfa::sm90::BwdConfig<Element, AB_HDIM>;

// The traits run_bwd takes for a call without masks: PlainTraits where a tree has them.
template <typename C, typename = void>
struct PlainOf { using type = typename C::Traits; };
template <typename C>
struct PlainOf<C, std::void_t<typename C::PlainTraits>> { using type = typename C::PlainTraits; };

// Trees before AttentionParams::accum_cols have rows as wide as H.
template <typename P>
auto set_accum_cols(P& p, int h, int) -> decltype(p.accum_cols = 0, void()) { p.accum_cols = h; }
template <typename P>
void set_accum_cols(P&, int, long) {}

// The float32 dK/dV workspace of causal GQA, in trees that have one.
template <typename P>
auto alloc_dkv_accum(P& p, int B, int K, int H, int) -> decltype(p.dkv_accum_rows(), (float*)nullptr) {
  float* dkv = nullptr;
  CK(cudaMalloc(&dkv, size_t(2) * B * K * p.dkv_accum_rows() * H * 4));
  p.dkv_accum = dkv;
  return dkv;
}
template <typename P>
float* alloc_dkv_accum(P&, int, int, int, long) { return nullptr; }

// The workspace of a [1, 1, T, S] mask's bits by key, in trees whose backward makes them.
template <typename P>
auto alloc_mask_key_bits(P& p, int T, int S, int) -> decltype(p.mask_key_bits = nullptr, (uint32_t*)nullptr) {
  uint32_t* bits = nullptr;
  CK(cudaMalloc(&bits, size_t(jfa::mask_chunks(S)) * jfa::kMaskChunkKeys * jfa::mask_words(T) * 4));
  p.mask_key_bits = bits;
  return bits;
}
template <typename P>
uint32_t* alloc_mask_key_bits(P&, int, int, long) { return nullptr; }

struct Case { int T, N, K; bool causal; };
constexpr Case kCases[] = {{1024, 2048 / AB_HDIM, 2048 / AB_HDIM, false}, {4096, 2048 / AB_HDIM, 2048 / AB_HDIM, false},
                           {16384, 2048 / AB_HDIM, 2048 / AB_HDIM, false}, {16384, 2048 / AB_HDIM, 2048 / AB_HDIM, true},
                           {8192, 2048 / AB_HDIM, 2048 / AB_HDIM / 8, false}, {8192, 2048 / AB_HDIM, 2048 / AB_HDIM / 8, true}};

enum class Mode { kPlain, kDropout, kDeterministic, kMaskCausal, kMaskBlock50, kMaskRandom50, kMaskBlock10 };
constexpr const char* kModeNames[] = {"plain", "dropout", "det", "causal", "block50", "random50", "block10"};

bool is_mask(Mode mode) { return mode >= Mode::kMaskCausal; }

ab::MaskPattern pattern_of(Mode mode) {
  return mode == Mode::kMaskCausal    ? ab::MaskPattern::kCausal
         : mode == Mode::kMaskBlock50 ? ab::MaskPattern::kBlock50
         : mode == Mode::kMaskBlock10 ? ab::MaskPattern::kBlock10
                                      : ab::MaskPattern::kRandom50;
}

void run_case(const Case& c, int rounds, Mode mode) {
  constexpr int H = AB_HDIM;
  const int B = 16384 / c.T, T = c.T, S = c.T;
  jfa::AttentionParams p;
  p.B = B; p.T = T; p.S = S; p.N = c.N; p.K = c.K; p.H = H; p.Hv = H;
  p.dtype = jfa::DType::kBFloat16;
  p.is_causal = c.causal;
  p.scale = 1.f / std::sqrt(float(H));
  p.scale_log2 = p.scale * 1.4426950408889634f;
  set_accum_cols(p, H, 0);
  p.deterministic = mode == Mode::kDeterministic;
  const int lanes = p.deterministic ? int(jfa::kDqLanes) : 1;
  const size_t nq = size_t(B) * T * c.N * H, nk = size_t(B) * S * c.K * H;
  void* buf[8];
  for (int i = 0; i < 8; ++i) {  // q k v o do dq dk dv
    const bool keys = i == 1 || i == 2 || i == 6 || i == 7;
    const size_t n = keys ? nk : nq;
    CK(cudaMalloc(&buf[i], n * sizeof(Element)));
    fill_random<<<1024, 256>>>(static_cast<Element*>(buf[i]), n, i + 1);
    CK(cudaGetLastError());
  }
  p.q = buf[0]; p.k = buf[1]; p.v = buf[2]; p.o = buf[3]; p.dout = buf[4]; p.dq = buf[5]; p.dk = buf[6]; p.dv = buf[7];
  p.q_strides = p.o_strides = p.do_strides = p.dq_strides = jfa::packed_strides(T, c.N, H);
  p.k_strides = p.v_strides = p.dk_strides = p.dv_strides = jfa::packed_strides(S, c.K, H);
  std::vector<float> lse(size_t(B) * T * c.N, std::log(float(S)) + 8.f);
  float *d_lse, *accum, *stats, *dkv = nullptr;
  CK(cudaMalloc(&d_lse, lse.size() * 4));
  CK(cudaMemcpy(d_lse, lse.data(), lse.size() * 4, cudaMemcpyHostToDevice));
  p.lse = d_lse;
  p.lse_strides = jfa::Strides{int64_t(T) * c.N, c.N, 1};
  CK(cudaMalloc(&accum, size_t(lanes) * B * c.N * p.dq_accum_rows() * H * 4));
  int32_t* semaphores = nullptr;
  if (p.deterministic) {
    CK(cudaMalloc(&semaphores, size_t(lanes) * B * c.N * p.dq_semaphores_per_head() * 4));
    p.dq_semaphore = semaphores;
  }
  uint32_t* seeds = nullptr;
  if (mode == Mode::kDropout) {
    std::vector<uint32_t> host(size_t(B) * 3);
    for (int b = 0; b < B; ++b) host[3 * b] = 0x1234u + b, host[3 * b + 1] = 0xBEEFu, host[3 * b + 2] = b;
    CK(cudaMalloc(&seeds, host.size() * 4));
    CK(cudaMemcpy(seeds, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
    p.mask.dropout_rate = 0.1f;
    p.mask.dropout_seeds = seeds;
  }
  uint32_t* mask_bits = nullptr;
  uint8_t* mask_tiles = nullptr;
  uint32_t* mask_key_bits = nullptr;  // the bits by key that the backward makes (params.h)
  if (is_mask(mode)) {
    p.mask.packed_mask = ab::packed_mask(pattern_of(mode), T, S, &mask_bits, &mask_tiles);
    mask_key_bits = alloc_mask_key_bits(p, T, S, 0);
  }
  CK(cudaMalloc(&stats, size_t(2) * B * c.N * p.dq_accum_rows() * 4));
  p.dq_accum = accum;
  p.softmax_d = stats;
  p.lse_log2 = stats + size_t(B) * c.N * p.dq_accum_rows();
  if (c.N > c.K) dkv = alloc_dkv_accum(p, B, c.K, H, 0);
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  auto launch = [&] {
    using namespace jfa::sm90::detail;
#ifdef AB_LAUNCH_WITHOUT_POLICIES  // trees before the policy-set kernels (2026-11-24 morning)
    return c.causal ? launch_bwd<typename Config::Traits, true>(p, stream)
                    : launch_bwd<typename PlainOf<Config>::type, false>(p, stream);
#else
#ifdef AB_DROPOUT
    if (mode == Mode::kDropout)
      return launch_bwd<typename Config::Traits, false, jfa::sm90::kBwdDropoutPositionsSet>(p, stream);
#endif
    if (is_mask(mode)) return launch_bwd<typename Config::Traits, false, jfa::sm90::kBwdMaskSet>(p, stream);
    return c.causal ? launch_bwd<typename Config::Traits, true, 0>(p, stream)
                    : launch_bwd<typename PlainOf<Config>::type, false, 0>(p, stream);
#endif
  };
  const std::vector<float> ms = ab::time_launches(launch, stream, rounds);
  const double flops = 2.5 * 4.0 * B * double(T) * S * c.N * H * (c.causal || mode == Mode::kMaskCausal ? 0.5 : 1.0);
  const float median = ms[ms.size() / 2];
  std::printf("AB root=%s mode=%s H=%d B=%d T=S=%d N=%d K=%d causal=%d | bwd %.3f ms %.1f TFLOP/s (min %.3f max %.3f)\n",
              AB_ROOT, kModeNames[int(mode)], H, B, T, c.N, c.K, int(c.causal), median, flops / median * 1e-9, ms.front(), ms.back());
  // AB_DIGEST=1: what the last launch computed, to compare trees: dK and dV bit for bit (each key
  // block's sums run in one fixed order) and dQ's sums (float atomics: equal up to rounding); and
  // dQ's bits after this launch and after one more (det: the same on every launch).
  if (std::getenv("AB_DIGEST") != nullptr) {
    const uint64_t digest[3] = {ab::digest(buf[6], nk * sizeof(Element)), ab::digest(buf[7], nk * sizeof(Element)),
                                ab::digest(buf[5], nq * sizeof(Element))};
    std::vector<Element> dq(nq);
    CK(cudaMemcpy(dq.data(), buf[5], nq * 2, cudaMemcpyDeviceToHost));
    double sum = 0, abs_sum = 0;
    for (Element x : dq) sum += float(x), abs_sum += std::fabs(float(x));
    CK(launch());
    CK(cudaStreamSynchronize(stream));
    const uint64_t dq_again = ab::digest(buf[5], nq * sizeof(Element));
    std::printf("DIGEST root=%s mode=%s T=%d dk=%016llx dv=%016llx dq_sum=%.6e dq_abs_sum=%.6e dq=%016llx dq_again=%016llx%s\n",
                AB_ROOT, kModeNames[int(mode)], T, (unsigned long long)digest[0], (unsigned long long)digest[1], sum,
                abs_sum, (unsigned long long)digest[2], (unsigned long long)dq_again,
                digest[2] == dq_again ? "" : " (dq differs between launches)");
    std::fflush(stdout);
  }
  for (void* b : buf) CK(cudaFree(b));
  CK(cudaFree(d_lse));
  CK(cudaFree(accum));
  CK(cudaFree(stats));
  if (dkv != nullptr) CK(cudaFree(dkv));
  if (semaphores != nullptr) CK(cudaFree(semaphores));
  if (seeds != nullptr) CK(cudaFree(seeds));
  if (mask_bits != nullptr) CK(cudaFree(mask_bits));
  if (mask_key_bits != nullptr) CK(cudaFree(mask_key_bits));
  if (mask_tiles != nullptr) CK(cudaFree(mask_tiles));
  CK(cudaStreamDestroy(stream));
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 15;
  const int min_t = argc > 2 ? std::atoi(argv[2]) : 0;
  const std::string name = argc > 3 ? argv[3] : "plain";
  Mode mode = Mode::kPlain;
  for (int m = 0; m < int(std::size(kModeNames)); ++m)
    if (name == kModeNames[m]) mode = Mode(m);
#ifndef AB_DROPOUT
  if (mode == Mode::kDropout) {
    std::printf("AB root=%s: built without -DAB_DROPOUT\n", AB_ROOT);
    return 0;
  }
#endif
  // AB_SMALL=1: one small case whose sizes are no multiple of a tile's, for compute-sanitizer.
  if (std::getenv("AB_SMALL") != nullptr) {
    run_case(Case{333, 2, 2, false}, rounds, mode);
    return 0;
  }
  for (const Case& c : kCases)
    if (c.T >= min_t && !(is_mask(mode) && (c.causal || c.N != c.K))) run_case(c, rounds, mode);
  return 0;
}
