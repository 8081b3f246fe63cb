// The sm90 (Hopper) forward kernel checked from C++, without JAX: random inputs (a fresh seed each
// run), NaN-poisoned outputs and guard rows, a double-precision CPU reference for o and lse, and a
// 16k timing against the portable sm80 forward. Built and run by .ci/gpu-run (sanitize step),
// under compute-sanitizer (memcheck, racecheck, synccheck) with --small.
// ./harness           correctness sweep + 16k timing
// ./harness --small   small correctness sweep only (for compute-sanitizer)
// ./harness --paged [H [page]]   the small sweep's paged cases only, of head dim H (and page size)
// ./harness --bench   timing only
// ./harness --masks   timing of the masked forward against plain causal (the masks' speed table),
//                      interleaved rounds, medians; --masks-bwd the same for the Hopper backward
//                      (deterministic=True as one more "mask")
// ./harness --deterministic-bwd   the Hopper backward with deterministic=True against the default,
//                      causal and not, interleaved rounds, medians
// ./harness --lengths timing of the plain forward at T = 1k..16k (B·T = 16k), sm90 only
// ./harness --hostcost host time of one forward call and of the CUDA calls it is made of
// ./harness --profile H causal [mask [T]]   one timing (for ncu: its 4th launch is the first timed
//                      one); mask: a BenchMask number (0 plain, 5 no-op window, 6 plain on T / 4,
//                      7 dropout 0.1, 8 no-op window on T / 4, 9 one segment on T / 4; the T / 4
//                      ones take a quarter of T), T: B = 16k / T
// JFA_BENCH_ROUNDS=1 makes --masks print every round's time as well (ROUNDS lines, in round
// order); JFA_BENCH_FIXED_ORDER=1 times its problems in one fixed order (see bench_masks).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check_util.h"
#include "jfa/mask.h"
#include "jfa/params.h"
#include "jfa/philox.h"
#include "jfa/score_mod.h"
#ifndef JFA_CHECK_NO_SM80
#include "sm80/api.h"
#endif
#include "sm90/api.h"

using jfa::AttentionParams;
using jfa::DType;

// Masking features of a case (the general path); 0 = the plain/causal kernels.
enum Feature : int {
  kWindow = 1, kBottomRight = 2, kLengths = 4, kSegments = 8, kSoftcap = 16, kAlibi = 32, kBias = 64,
  kMask = 128, kDropout = 256,
  // ALiBi with a scale of 1e-4 and head 0's slope 7: slope / scale past fp16's range (the kernel's
  // fp16 fallback from the tensor cores' ALiBi prefix to the per-element term: fwd_kernel.h,
  // kAlibiPrefix). A steep slope itself would not do: the kernels keep ALiBi's term relative to the
  // tile's first row (mask.h, apply_policy), so float holds slope · 192 to ~1e-7 relative only.
  kSteepAlibi = 512,
  // Segment ids that are not packed sequences: runs of random ids, so one id holds several runs of
  // keys (tile_rows then cannot fold a row's segment into its position bounds: mask.h).
  kScatteredSegments = 1024,
  // Packed sequences whose boundaries fall on the summaries' 16-position chunks, as the timed
  // 4096-key sequences do: rows fold their segment into their position bounds (mask.h, tile_rows).
  kChunkAlignedSegments = 2048,
  // K and V as page pools read through a block table (AttentionParams::paged): pages of the case's
  // `page` rows, else 256 where S is a multiple of 256, else 128, in random order; rows past each
  // length and the spare pages NaN (the kernel must zero what it reads of them: paged_kv.h). S a
  // multiple of the page, no pad.
  kPaged = 4096
};

struct Config {
  int B, T, S, N, K, H;
  bool causal;
  DType dt;
  int pad;  // extra elements per row (non-packed strides, a multiple of 8 so TMA takes them)
  int features = 0;
  int page = 0;  // kPaged: rows per page (0: 256 or 128, whichever divides S)
};

// Host and device copies of a case's mask operands; `host` points into the vectors (for the
// reference, which calls jfa::visible / jfa::modify_score itself), `device` into GPU buffers.
struct MaskOperands {
  std::vector<int32_t> q_len, kv_len, q_seg, kv_seg, q_chunks, kv_chunks;  // chunks: segment summaries
  std::vector<float> slopes, bias;
  PackedMaskHost mask;
  std::vector<uint32_t> seeds;  // dropout: (k0, k1, batch) per batch element
  jfa::MaskParams host, device;
  std::vector<void*> buffers;

  template <typename V>
  const typename V::value_type* upload(const V& h) {
    if (h.empty()) return nullptr;
    void* d;
    CK(cudaMalloc(&d, h.size() * sizeof(h[0])));
    CK(cudaMemcpy(d, h.data(), h.size() * sizeof(h[0]), cudaMemcpyHostToDevice));
    buffers.push_back(d);
    return static_cast<const typename V::value_type*>(d);
  }
  ~MaskOperands() {
    for (void* b : buffers) cudaFree(b);
  }
};

// Sorted segment ids (packed sequences) of `len` positions with `count` segments of random sizes.
static std::vector<int32_t> packed_segments(int len, int count, std::mt19937& rng) {
  std::vector<int32_t> ids(len);
  for (auto& x : ids) x = int32_t(rng() % count);
  std::sort(ids.begin(), ids.end());
  return ids;
}

// Sorted ids of `count` segments whose boundaries are multiples of jfa::kSegmentChunk.
static std::vector<int32_t> chunk_aligned_segments(int len, int count, std::mt19937& rng) {
  std::vector<int> cuts;
  for (int s = 1; s < count; ++s) cuts.push_back(int(rng() % (len / jfa::kSegmentChunk + 1)) * jfa::kSegmentChunk);
  std::sort(cuts.begin(), cuts.end());
  std::vector<int32_t> ids(len);
  for (int i = 0; i < len; ++i) ids[i] = int32_t(std::upper_bound(cuts.begin(), cuts.end(), i) - cuts.begin());
  return ids;
}

// Runs of 1 to 400 positions, each of a random id of three: the ids repeat out of order.
static std::vector<int32_t> scattered_segments(int len, std::mt19937& rng) {
  std::vector<int32_t> ids;
  while (int(ids.size()) < len) {
    const int run = 1 + int(rng() % 400), id = int(rng() % 3);
    for (int i = 0; i < run && int(ids.size()) < len; ++i) ids.push_back(id);
  }
  return ids;
}

static void make_masks(const Config& c, MaskOperands& m, std::mt19937& rng) {
  jfa::MaskParams& h = m.host;
  if (c.features & kWindow) { h.window_left = 37; h.window_right = 5; }
  h.bottom_right = (c.features & kBottomRight) != 0;
  if (c.features & kLengths)
    for (int b = 0; b < c.B; ++b) {
      // Batch 0 keeps a few rows and keys (b = 0 may even have no query); the others random.
      m.q_len.push_back(b == 0 ? int(rng() % 3) : int(rng() % (c.T + 1)));
      m.kv_len.push_back(b == 0 ? 1 + int(rng() % 5) : int(rng() % (c.S + 1)));
    }
  const bool scattered = (c.features & kScatteredSegments) != 0, aligned = (c.features & kChunkAlignedSegments) != 0;
  auto segments = [&](int len) {
    return scattered ? scattered_segments(len, rng) : aligned ? chunk_aligned_segments(len, 4, rng)
                                                              : packed_segments(len, 3, rng);
  };
  if (c.features & (kSegments | kScatteredSegments | kChunkAlignedSegments))
    for (int b = 0; b < c.B; ++b) {
      auto q = segments(c.T);
      auto k = segments(c.S);
      m.q_seg.insert(m.q_seg.end(), q.begin(), q.end());
      m.kv_seg.insert(m.kv_seg.end(), k.begin(), k.end());
    }
  if (c.features & (kSegments | kScatteredSegments | kChunkAlignedSegments)) {
    m.q_chunks = segment_chunks(m.q_seg, c.T, m.kv_seg, c.S, c.B);
    m.kv_chunks = segment_chunks(m.kv_seg, c.S, m.q_seg, c.T, c.B);
  }
  if (c.features & kSoftcap) h.softcap = 4.f;
  std::uniform_real_distribution<float> ud(0.01f, 0.3f);
  if (c.features & (kAlibi | kSteepAlibi))
    for (int n = 0; n < c.N; ++n) m.slopes.push_back(n == 0 && (c.features & kSteepAlibi) ? 7.f : ud(rng));
  std::normal_distribution<float> nd(0.f, 1.f);
  if (c.features & kBias) {  // [1, N, 1, S]: broadcast over batch and queries
    for (int i = 0; i < c.N * c.S; ++i) m.bias.push_back(nd(rng));
    h.bias_strides = jfa::Strides4{0, c.S, 0, 1};
  }
  if (c.features & kMask)  // [B, 1, T, S]: empty, full and mixed tiles (tiled_random_mask)
    m.mask = pack_mask_host(tiled_random_mask(c.B, c.T, c.S, 800, rng), c.B, c.T, c.S);
  if (c.features & kDropout) {
    h.dropout_rate = 0.3f;
    for (int b = 0; b < c.B; ++b) m.seeds.insert(m.seeds.end(), {uint32_t(rng()), uint32_t(rng()), uint32_t(b + 5)});
  }
  auto ptr = [](auto& v) { return v.empty() ? nullptr : v.data(); };
  h.q_lengths = ptr(m.q_len); h.kv_lengths = ptr(m.kv_len);
  h.q_segment_ids = ptr(m.q_seg); h.kv_segment_ids = ptr(m.kv_seg);
  h.alibi_slopes = ptr(m.slopes); h.bias = ptr(m.bias);
  if (!m.mask.bits.empty()) h.packed_mask = packed_mask_view(m.mask.bits.data(), m.mask.tiles.data(), c.T, c.S);
  h.dropout_seeds = ptr(m.seeds);
  m.device = h;
  m.device.q_lengths = m.upload(m.q_len); m.device.kv_lengths = m.upload(m.kv_len);
  m.device.q_segment_ids = m.upload(m.q_seg); m.device.kv_segment_ids = m.upload(m.kv_seg);
  m.device.q_segment_chunks = m.upload(m.q_chunks); m.device.kv_segment_chunks = m.upload(m.kv_chunks);
  m.device.alibi_slopes = m.upload(m.slopes); m.device.bias = m.upload(m.bias);
  if (!m.mask.bits.empty())
    m.device.packed_mask = packed_mask_view(m.upload(m.mask.bits), m.upload(m.mask.tiles), c.T, c.S);
  m.device.dropout_seeds = m.upload(m.seeds);
}

// Host copy of a [B, rows, heads, H] tensor with row stride heads*H + pad, plus `guard` rows
// after the end that must never be written.
struct Tensor4 {
  int B, rows, heads, H, pad;
  std::vector<uint16_t> data;
  jfa::Strides strides() const {
    int64_t row = int64_t(heads) * H + pad;
    return jfa::Strides{row * rows, row, H};
  }
  size_t size() const { return size_t(B) * rows * (size_t(heads) * H + pad); }
  size_t idx(int b, int r, int h, int d) const {
    auto s = strides();
    return b * s.batch + r * s.row + h * s.head + d;
  }
};
constexpr size_t kGuard = 4096;  // elements of NaN after each output: rows >= T must stay NaN

static int g_failures = 0;

// The dynamic scheduler's counter (as the FFI handler passes it), allocated once.
static int32_t* tile_counter() {
  static int32_t* counter = nullptr;
  if (counter == nullptr) CK(cudaMalloc(&counter, sizeof(int32_t)));
  return counter;
}

static void run_case(const Config& c, std::mt19937& rng) {
  const char* dtn = c.dt == DType::kBFloat16 ? "bf16" : "fp16";
  if (jfa::sm90::kernel_head_dim(c.dt, c.H) < 0) {
    printf("SKIP (not built) %s H=%d\n", dtn, c.H);
    return;
  }
  Tensor4 q{c.B, c.T, c.N, c.H, c.pad}, k{c.B, c.S, c.K, c.H, c.pad}, v{c.B, c.S, c.K, c.H, c.pad},
      o{c.B, c.T, c.N, c.H, c.pad};
  std::normal_distribution<float> nd(0.f, 1.f);
  for (Tensor4* t : {&q, &k, &v}) {
    t->data.resize(t->size());
    for (auto& x : t->data) x = from_float(nd(rng), c.dt);
  }
  auto upload = [](const std::vector<uint16_t>& h) {
    void* d;
    CK(cudaMalloc(&d, h.size() * 2));
    CK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    return d;
  };
  const float scale = c.features & kSteepAlibi ? 1e-4f : 1.f / std::sqrt(float(c.H));
  AttentionParams p;
  p.B = c.B; p.T = c.T; p.S = c.S; p.N = c.N; p.K = c.K; p.H = c.H; p.Hv = c.H;
  p.dtype = c.dt;
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.is_causal = c.causal;
  MaskOperands masks;
  make_masks(c, masks, rng);
  p.mask = masks.device;
  AttentionParams ph = p;  // the reference's view: host copies of the mask operands
  ph.mask = masks.host;
  p.q = upload(q.data); p.k = upload(k.data); p.v = upload(v.data);
  p.q_strides = q.strides(); p.k_strides = k.strides(); p.v_strides = v.strides();
  std::vector<void*> paged_buffers;
  if (c.features & kPaged) {
    const int page = c.page ? c.page : c.S % 256 == 0 ? 256 : 128, per_sequence = c.S / page,
              pages = c.B * per_sequence + 2;
    std::vector<int32_t> order(pages), table(size_t(c.B) * per_sequence);
    for (int i = 0; i < pages; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    const size_t row = size_t(c.K) * c.H;
    for (Tensor4* t : {&k, &v}) {
      std::vector<uint16_t> pool(size_t(pages) * page * row, 0xFFFF);  // NaN in fp16 and bf16
      for (int b = 0; b < c.B; ++b)
        for (int j = 0; j < int(jfa::clamp_length(masks.host.kv_lengths, b, c.S)); ++j) {
          const int id = order[b * per_sequence + j / page];
          std::copy_n(&t->data[t->idx(b, j, 0, 0)], row, &pool[(size_t(id) * page + j % page) * row]);
        }
      paged_buffers.push_back(upload(pool));
    }
    for (size_t i = 0; i < table.size(); ++i) table[i] = order[i];
    void* d_table;
    CK(cudaMalloc(&d_table, table.size() * 4));
    CK(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    paged_buffers.push_back(d_table);
    p.k = paged_buffers[0]; p.v = paged_buffers[1];
    p.k_strides = p.v_strides = jfa::packed_strides(page, c.K, c.H);
    p.paged = jfa::PagedKV{static_cast<const int32_t*>(d_table), per_sequence, page, pages};
  }
  const size_t o_elems = o.size(), rows = size_t(c.B) * c.T * c.N;
  void* d_o;
  float* d_lse;
  CK(cudaMalloc(&d_o, (o_elems + kGuard) * 2));
  CK(cudaMemset(d_o, 0xFF, (o_elems + kGuard) * 2));  // 0xFFFF is NaN in fp16 and bf16
  CK(cudaMalloc(&d_lse, (rows + kGuard) * 4));
  CK(cudaMemset(d_lse, 0xFF, (rows + kGuard) * 4));
  p.o = d_o; p.o_strides = o.strides();
  p.lse = d_lse; p.lse_strides = jfa::Strides{int64_t(c.T) * c.N, c.N, 1};
  // Every other case runs the static schedule (no counter), the kernel's fallback.
  static int case_index = 0;
  p.tile_counter = case_index++ % 2 == 0 ? tile_counter() : nullptr;
  if (!jfa::sm90::can_implement(p)) {
    printf("FAIL can_implement rejected %s T=%d S=%d\n", dtn, c.T, c.S);
    ++g_failures;
    return;
  }
  CK(jfa::sm90::forward(p, nullptr));
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> h_o(o_elems + kGuard);
  std::vector<float> h_lse(rows + kGuard);
  CK(cudaMemcpy(h_o.data(), d_o, h_o.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_lse.data(), d_lse, h_lse.size() * 4, cudaMemcpyDeviceToHost));

  // Reference over (b, n) in threads, on inputs converted once.
  const int G = c.N / c.K;
  auto widen = [&](const Tensor4& t) {
    std::vector<float> f(t.data.size());
    for (size_t i = 0; i < f.size(); ++i) f[i] = to_float(t.data[i], c.dt);
    return f;
  };
  const std::vector<float> qf = widen(q), kf = widen(k), vf = widen(v);
  std::vector<double> ref_o(rows * c.H), ref_lse(rows);
  auto work = [&](int bn) {
    const int b = bn / c.N, n = bn % c.N, kh = n / G;
    std::vector<double> s(c.S);
    const jfa::SequenceBounds bounds = jfa::sequence_bounds(ph, b);
    for (int t = 0; t < c.T; ++t) {
      const int smax = c.causal && !c.features ? std::min(c.S, t + 1) : c.S;
      double m = -INFINITY;
      for (int j = 0; j < smax; ++j) {
        if (c.features && !jfa::visible(ph, bounds, b, n, t, j)) {
          s[j] = -INFINITY;
          continue;
        }
        double acc = 0;
        for (int d = 0; d < c.H; ++d)
          acc += double(qf[q.idx(b, t, n, d)]) * kf[k.idx(b, j, kh, d)];
        s[j] = acc * scale;
        if (c.features)  // the shared modifier works in log2 units, in float like the kernels
          s[j] = jfa::modify_score(ph, bounds, b, n, t, j, float(s[j] * M_LOG2E), nullptr) / M_LOG2E;
        m = std::max(m, s[j]);
      }
      const size_t row = (size_t(b) * c.T + t) * c.N + n;
      if (m == -INFINITY) {  // no visible key: o = 0, lse = -inf
        ref_lse[row] = -INFINITY;
        for (int d = 0; d < c.H; ++d) ref_o[row * c.H + d] = 0;
        continue;
      }
      double l = 0;
      for (int j = 0; j < smax; ++j) l += (s[j] = std::exp(s[j] - m));
      ref_lse[row] = m + std::log(l);
      if (ph.mask.has_dropout()) {  // the row sum and LSE stay dropout-free
        const uint32_t* seed = ph.mask.dropout_seeds + 3 * b;
        const uint32_t threshold = jfa::dropout_threshold(ph.mask.dropout_rate);
        for (int j = 0; j < smax; ++j) {
          const bool dropped = jfa::dropout_uniform(seed[0], seed[1], seed[2], n, t, j) < threshold;
          s[j] = dropped ? 0.0 : s[j] / (1.0 - ph.mask.dropout_rate);
        }
      }
      for (int d = 0; d < c.H; ++d) {
        double acc = 0;
        for (int j = 0; j < smax; ++j) acc += s[j] * vf[v.idx(b, j, kh, d)];
        ref_o[row * c.H + d] = acc / l;
      }
    }
  };
  const int jobs = c.B * c.N;
  const int nthreads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int w = 0; w < nthreads; ++w)
    pool.emplace_back([&, w] {
      for (int j = w; j < jobs; j += nthreads) work(j);
    });
  for (auto& th : pool) th.join();

  double num = 0, den = 0, lnum = 0, lden = 0;
  bool finite = true, empty_rows_ok = true;
  for (int b = 0; b < c.B; ++b)
    for (int t = 0; t < c.T; ++t)
      for (int n = 0; n < c.N; ++n) {
        const size_t row = (size_t(b) * c.T + t) * c.N + n;
        if (std::isinf(ref_lse[row])) {  // a row that sees no key: exactly o = 0, lse = -inf
          empty_rows_ok = empty_rows_ok && std::isinf(h_lse[row]) && h_lse[row] < 0;
          for (int d = 0; d < c.H; ++d) empty_rows_ok = empty_rows_ok && to_float(h_o[o.idx(b, t, n, d)], c.dt) == 0.f;
          continue;
        }
        for (int d = 0; d < c.H; ++d) {
          const double x = to_float(h_o[o.idx(b, t, n, d)], c.dt), r = ref_o[row * c.H + d];
          finite = finite && std::isfinite(x);
          num += (x - r) * (x - r);
          den += r * r;
        }
        const double l = h_lse[row];
        finite = finite && std::isfinite(l);
        lnum += (l - ref_lse[row]) * (l - ref_lse[row]);
        lden += ref_lse[row] * ref_lse[row];
      }
  // Padding elements and the guard after the end were never written.
  bool untouched = true;
  for (int b = 0; b < c.B; ++b)
    for (int t = 0; t < c.T && c.pad; ++t)
      for (int e = 0; e < c.pad; ++e) untouched = untouched && h_o[o.idx(b, t, c.N - 1, c.H - 1) + 1 + e] == 0xFFFF;
  for (size_t i = o_elems; i < o_elems + kGuard; ++i) untouched = untouched && h_o[i] == 0xFFFF;
  for (size_t i = rows; i < rows + kGuard; ++i) untouched = untouched && std::isnan(h_lse[i]);
  const double err = std::sqrt(num / std::max(den, 1e-30)), lerr = std::sqrt(lnum / std::max(lden, 1e-30));
  const double tol = c.dt == DType::kBFloat16 ? 2e-2 : 3e-3;
  const bool ok = finite && untouched && empty_rows_ok && err <= tol && lerr <= 1e-4;
  if (!ok) ++g_failures;
  printf("%s %s B=%d T=%d S=%d N=%d K=%d H=%d causal=%d pad=%d features=%d | rel o %.2e lse %.2e%s%s%s\n",
         ok ? "PASS" : "FAIL", dtn, c.B, c.T, c.S, c.N, c.K, c.H, c.causal, c.pad, c.features, err, lerr,
         finite ? "" : " NONFINITE", untouched ? "" : " WROTE-OUTSIDE", empty_rows_ok ? "" : " EMPTY-ROWS-WRONG");
  fflush(stdout);
  for (void* ptr : {(void*)p.q, d_o, (void*)d_lse}) CK(cudaFree(ptr));
  for (void* ptr : paged_buffers) CK(cudaFree(ptr));
  if (!(c.features & kPaged))
    for (void* ptr : {(void*)p.k, (void*)p.v}) CK(cudaFree(ptr));
}

static bool g_skip_sm80 = false;  // --lengths times the sm90 kernel only

// Masks of the speed table: causal attention plus one feature, on T = S.
// kQuarterCausal is no mask: plain causal on sequences of T / 4 (B x 16), the same useful FLOPs in
// tiles of the same trip counts as window(2048, 0) and 4 segments of T / 4 at T = 16k, whose cost
// beside plain causal at T is then the masks' alone, not that of shorter rows. kQuarterWideWindow is
// the general kernel's own cost on those rows (a window that hides nothing, on T / 4), and
// kQuarterOneSegment the segment-id kernel's (one segment per sequence, on T / 4): beside
// kSegments, what packing four sequences into one row costs. kCausalMask and kRandomMask are boolean
// masks as jax_flashattn packs them, on a call that is not causal: the causal triangle (beside
// is_causal, the cost of getting it as a tensor) and a random half of the pairs (every tile partial;
// about as many useful FLOPs as plain causal).
enum class BenchMask {
  kNone, kWindow, kAlibi, kSegments, kSoftcap, kWideWindow, kQuarterCausal, kDropout, kQuarterWideWindow,
  kQuarterOneSegment, kDeterministic, kCausalMask, kRandomMask
};
static const char* bench_mask_name(BenchMask m) {
  switch (m) {
    case BenchMask::kNone: return "plain";
    case BenchMask::kWindow: return "window(2048,0)";
    case BenchMask::kAlibi: return "alibi";
    case BenchMask::kSegments: return "segments(4 x T/4)";
    case BenchMask::kSoftcap: return "softcap";
    case BenchMask::kWideWindow: return "window(T,0)";  // hides nothing: the general kernel's own cost
    case BenchMask::kQuarterCausal: return "plain(T/4)";
    case BenchMask::kQuarterWideWindow: return "window(T,0)(T/4)";
    case BenchMask::kQuarterOneSegment: return "segments(1 x T)(T/4)";
    case BenchMask::kDropout: return "dropout(0.1)";
    case BenchMask::kDeterministic: return "deterministic";  // no mask: the backward's ordered dQ adds
    case BenchMask::kCausalMask: return "causal as a packed mask";  // the causal triangle as bits
    case BenchMask::kRandomMask: return "random packed mask (p 0.5)";  // every tile partial
  }
  return "?";
}

// One timed problem: causal or plain attention on T = S plus one BenchMask, with its buffers.
// A masked run compares with plain causal at the same useful FLOPs: masks that hide
// most of the causal triangle (window, segments) get a larger batch B, so that both runs do about
// as much useful work and fill the GPU alike.
struct BenchProblem {
  AttentionParams p;
  MaskOperands masks;
  void* bufs[4] = {nullptr, nullptr, nullptr, nullptr};
  float* lse = nullptr;
  double flops = 0;  // useful FLOPs of one call
  BenchMask mask = BenchMask::kNone;

  BenchProblem(DType dt, int H, int B, int T_full, int N, bool causal, BenchMask bm) : mask(bm) {
    const bool quarter = bm == BenchMask::kQuarterCausal || bm == BenchMask::kQuarterWideWindow ||
                         bm == BenchMask::kQuarterOneSegment;
    const int T = quarter ? T_full / 4 : T_full;
    p.B = 1; p.T = T; p.S = T; p.N = N; p.K = N; p.H = H; p.Hv = H; p.dtype = dt;
    p.scale = 1.f / std::sqrt(float(H));
    p.scale_log2 = p.scale * 1.4426950408889634f;
    p.is_causal = causal;
    p.tile_counter = std::getenv("JFA_STATIC_SCHEDULE") ? nullptr : tile_counter();
    // Boolean masks, shared by the batch and the heads, packed as jax_flashattn packs them; the
    // call itself is not causal (the causal mask comes as the tensor).
    const bool bool_mask = bm == BenchMask::kCausalMask || bm == BenchMask::kRandomMask;
    double mask_pairs = 0;
    if (bool_mask) {
      p.is_causal = false;
      std::vector<uint8_t> dense(size_t(T) * T);
      std::mt19937 mask_rng(7);
      for (int i = 0; i < T; ++i)
        for (int j = 0; j < T; ++j) {
          const bool v = bm == BenchMask::kCausalMask ? j <= i : (mask_rng() & 1u) != 0;
          dense[size_t(i) * T + j] = v;
          mask_pairs += v;
        }
      masks.mask = pack_mask_host(dense, 1, T, T);
    }
    if (bm == BenchMask::kWindow) masks.host.window_left = 2048;
    if (bm == BenchMask::kWideWindow || bm == BenchMask::kQuarterWideWindow) masks.host.window_left = T;
    if (bm == BenchMask::kSoftcap) masks.host.softcap = 30.f;
    if (bm == BenchMask::kDropout) masks.host.dropout_rate = 0.1f;
    if (bm == BenchMask::kAlibi) {
      // JFA_BENCH_SLOPE_FACTOR scales the slopes: with 0, the cost of ALiBi's code alone.
      const char* f = std::getenv("JFA_BENCH_SLOPE_FACTOR");
      const float factor = f ? float(std::atof(f)) : 1.f;
      for (int n = 0; n < N; ++n) masks.slopes.push_back(factor * std::exp2(-8.f * (n + 1) / N));
    }
    // Useful FLOPs: 4·H per visible (query, key) pair, pairs counted with the shared policies (the
    // batches are alike: count one).
    AttentionParams ph = p;
    ph.mask = masks.host;
    double pairs = 0;
    {
      const jfa::SequenceBounds sb = jfa::sequence_bounds(ph, 0);
      for (int i = 0; i < T; ++i) {
        int64_t lo = jfa::key_lo(ph, sb, i), hi = jfa::key_hi(ph, sb, i);
        if (bm == BenchMask::kSegments) {
          const int64_t len = T / 4, seg0 = i / len * len;
          lo = std::max(lo, seg0);
          hi = std::min(hi, seg0 + len);
        }
        pairs += double(std::max<int64_t>(hi - lo, 0));
      }
      if (bool_mask) pairs = mask_pairs;
    }
    if (bm != BenchMask::kNone && bm != BenchMask::kDeterministic) {
      const double plain_pairs = causal ? 0.5 * double(T_full) * (T_full + 1) : double(T_full) * T_full;
      B = std::max(1, int(std::lround(B * plain_pairs / pairs)));
    }
    pairs *= B;
    p.B = B;
    flops = bm == BenchMask::kNone || bm == BenchMask::kDeterministic ? 4.0 * B * double(T) * T * N * H * (causal ? 0.5 : 1.0) : 4.0 * pairs * N * H;
    if (bm == BenchMask::kSegments || bm == BenchMask::kQuarterOneSegment)
      for (int b = 0; b < B; ++b)
        for (int i = 0; i < T; ++i) masks.q_seg.push_back(bm == BenchMask::kSegments ? i / (T / 4) : 0);
    masks.kv_seg = masks.q_seg;
    p.mask = masks.host;
    if (bool_mask)
      p.mask.packed_mask = packed_mask_view(masks.upload(masks.mask.bits), masks.upload(masks.mask.tiles), T, T);
    p.mask.alibi_slopes = masks.upload(masks.slopes);
    p.mask.q_segment_ids = masks.upload(masks.q_seg);
    p.mask.kv_segment_ids = masks.upload(masks.kv_seg);
    if (bm == BenchMask::kDropout) {
      for (int b = 0; b < B; ++b) masks.seeds.insert(masks.seeds.end(), {0x1234u, 0x5678u, uint32_t(b)});
      p.mask.dropout_seeds = masks.upload(masks.seeds);
    }
    if (!masks.q_seg.empty()) {
      masks.q_chunks = segment_chunks(masks.q_seg, T, masks.kv_seg, T, B);
      p.mask.q_segment_chunks = p.mask.kv_segment_chunks = masks.upload(masks.q_chunks);  // same ids both sides
    }
    const size_t n = size_t(B) * T * N * H, rows = size_t(B) * T * N;
    std::vector<uint16_t> h(n);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& x : h) x = from_float(nd(rng), dt);
    for (auto& b : bufs) {
      CK(cudaMalloc(&b, n * 2));
      CK(cudaMemcpy(b, h.data(), n * 2, cudaMemcpyHostToDevice));
    }
    CK(cudaMalloc(&lse, rows * 4));
    auto st = jfa::packed_strides(T, N, H);
    p.q = bufs[0]; p.k = bufs[1]; p.v = bufs[2]; p.o = bufs[3];
    p.q_strides = p.k_strides = p.v_strides = p.o_strides = st;
    p.lse = lse; p.lse_strides = jfa::Strides{int64_t(T) * N, N, 1};
  }
  BenchProblem(const BenchProblem&) = delete;
  BenchProblem& operator=(const BenchProblem&) = delete;
  ~BenchProblem() {
    for (auto& b : bufs) cudaFree(b);
    for (auto& b : bwd_bufs) cudaFree(b);
    cudaFree(mask_key_bits);
    cudaFree(lse);
  }

  // The Hopper backward's operands and workspace (params.h), the LSE from one forward call; with
  // ALiBi d(slopes) too. Backward FLOPs: 2.5 x the forward's.
  void* bwd_bufs[8] = {};
  uint32_t* mask_key_bits = nullptr;
  void enable_backward(cudaStream_t s) {
    const size_t n = size_t(p.B) * p.T * p.N * p.H, rows = size_t(p.B) * p.N * p.dq_accum_rows();
    // Every lane of the deterministic run's dQ accumulator and semaphores.
    const size_t sizes[8] = {n * 2, n * 2, n * 2, n * 2, jfa::kDqLanes * rows * p.H * 4, 2 * rows * 4,
                             size_t(jfa::kDqLanes * p.B * p.N * p.dq_semaphores_per_head()) * 4,
                             size_t(p.B * p.N * ((p.S + jfa::kDslopeKeys - 1) / jfa::kDslopeKeys)) * 4};
    for (int i = 0; i < 8; ++i) {
      CK(cudaMalloc(&bwd_bufs[i], sizes[i]));
      CK(cudaMemset(bwd_bufs[i], 0, sizes[i]));
    }
    CK(cudaMemcpy(bwd_bufs[0], bufs[0], n * 2, cudaMemcpyDeviceToDevice));  // dO: Q's values
    p.dout = bwd_bufs[0]; p.dq = bwd_bufs[1]; p.dk = bwd_bufs[2]; p.dv = bwd_bufs[3];
    p.do_strides = p.dq_strides = p.dk_strides = p.dv_strides = p.q_strides;
    p.dq_accum = static_cast<float*>(bwd_bufs[4]);
    p.softmax_d = static_cast<float*>(bwd_bufs[5]);
    p.lse_log2 = p.softmax_d + rows;
    p.deterministic = mask == BenchMask::kDeterministic;
    p.dq_semaphore = static_cast<int32_t*>(bwd_bufs[6]);
    if (p.mask.alibi_slopes != nullptr) {
      p.mask.dslopes = static_cast<float*>(bwd_bufs[7]);
      p.mask.dslope_slots = (p.S + jfa::kDslopeKeys - 1) / jfa::kDslopeKeys;
    }
    if (p.mask.packed_mask.present()) {  // the mask's bits by key (params.h: mask_key_bits), any slices
      const size_t words = size_t(p.B) * p.N * jfa::mask_chunks(p.S) * jfa::kMaskChunkKeys * jfa::mask_words(p.T);
      CK(cudaMalloc(&mask_key_bits, words * 4));
      p.mask_key_bits = mask_key_bits;
    }
    CK(jfa::sm90::forward(p, s));
    backward_flops = 2.5 * flops;
  }
  double backward_flops = 0;

  cudaError_t forward(cudaStream_t s, bool sm90) const {
#ifdef JFA_CHECK_NO_SM80
    (void)sm90;
    return jfa::sm90::forward(p, s);
#else
    return sm90 ? jfa::sm90::forward(p, s) : jfa::sm80::forward(p, s);
#endif
  }
  // The pass timed by bench_masks: the Hopper backward once enable_backward ran, else the forward.
  cudaError_t timed_pass(cudaStream_t s) const {
    return backward_flops > 0 ? jfa::sm90::backward(p, s) : jfa::sm90::forward(p, s);
  }
  // Milliseconds per call of `calls` back-to-back calls (bench_masks: of timed_pass).
  float time_ms(cudaStream_t s, cudaEvent_t e0, cudaEvent_t e1, bool sm90, int calls = 5, bool pass = false) const {
    CK(cudaEventRecord(e0, s));
    for (int i = 0; i < calls; ++i) CK(pass ? timed_pass(s) : forward(s, sm90));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    return t / calls;
  }
};

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static void bench(DType dt, int H, int B, int T, int N, bool causal, BenchMask bm = BenchMask::kNone) {
  if (!jfa::sm90::is_built(dt, H)) return;
  const BenchProblem prob(dt, H, B, T, N, causal, bm);
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto time = [&](bool sm90) {
    for (int i = 0; i < 3; ++i) CK(prob.forward(s, sm90));
    std::vector<float> ms;
    for (int r = 0; r < 10; ++r) ms.push_back(prob.time_ms(s, e0, e1, sm90));
    return median(ms);
  };
  const float t90 = time(true);
#ifdef JFA_CHECK_NO_SM80
  const float t80 = 0.f;
#else
  const float t80 = jfa::sm80::is_built(dt, H) && !g_skip_sm80 ? time(false) : 0.f;
#endif
  printf("BENCH %s H=%d B=%d T=S=%d N=%d causal=%d mask=%s | sm90 fwd %.3f ms %.1f TFLOP/s | sm80 fwd %.3f ms %.1f "
         "TFLOP/s (useful FLOPs)\n",
         dt == DType::kBFloat16 ? "bf16" : "fp16", H, int(prob.p.B), int(prob.p.T), N, causal, bench_mask_name(bm), t90,
         prob.flops / t90 * 1e-9, t80, t80 > 0 ? prob.flops / t80 * 1e-9 : 0.0);
  fflush(stdout);
  CK(cudaStreamDestroy(s));
}

// The masks' speed table (--masks; --masks-bwd: the backward): per head dim, plain causal and each
// mask on the sm90 forward (or backward),
// their timing rounds interleaved (round r times every problem once, in a shuffled order), so
// that clock and temperature drift reach all of them alike; medians of the rounds, and each
// mask's median as a percentage of plain causal at the same useful FLOPs.
// The references: kNone and kQuarterCausal (the masks on T / 4). `only_ordered`: kNone against
// deterministic=True alone (--deterministic-bwd), causal or not.
static void bench_masks(DType dt, int H, int T, int N, int rounds, bool backward, bool only_ordered = false,
                        bool causal = true) {
  if (!jfa::sm90::is_built(dt, H)) return;
  std::vector<std::unique_ptr<BenchProblem>> probs;
  std::vector<BenchMask> masks = {BenchMask::kNone, BenchMask::kQuarterCausal, BenchMask::kQuarterWideWindow,
                                  BenchMask::kQuarterOneSegment, BenchMask::kWideWindow, BenchMask::kWindow,
                                  BenchMask::kAlibi, BenchMask::kSegments, BenchMask::kSoftcap, BenchMask::kDropout,
                                  BenchMask::kCausalMask, BenchMask::kRandomMask};
  if (only_ordered) masks = {BenchMask::kNone};
  if (backward) masks.push_back(BenchMask::kDeterministic);
  for (BenchMask m : masks) probs.push_back(std::make_unique<BenchProblem>(dt, H, 1, T, N, causal, m));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  if (backward)
    for (auto& pr : probs) pr->enable_backward(s);
  for (auto& pr : probs)
    for (int i = 0; i < 3; ++i) CK(pr->timed_pass(s));
  // Each round times the problems in an order of its own (shuffled, seeded by the round), each
  // after two untimed calls: in a fixed order each problem inherits the clocks and power state of
  // the one before it (docs/performance.md, "Benchmark method"). JFA_BENCH_FIXED_ORDER=1 keeps the
  // fixed order, without the untimed calls.
  const bool fixed_order = std::getenv("JFA_BENCH_FIXED_ORDER") != nullptr;
  std::vector<size_t> order(probs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<std::vector<float>> ms(probs.size());
  for (int r = 0; r < rounds; ++r) {
    if (!fixed_order) std::shuffle(order.begin(), order.end(), std::mt19937(unsigned(r)));
    for (size_t i : order) {
      if (!fixed_order)
        for (int w = 0; w < 2; ++w) CK(probs[i]->timed_pass(s));
      ms[i].push_back(probs[i]->time_ms(s, e0, e1, true, 5, true));
    }
  }
  auto flops_of = [&](size_t i) { return backward ? probs[i]->backward_flops : probs[i]->flops; };
  const double plain = flops_of(0) / median(ms[0]) * 1e-9;
  const double plain_quarter = only_ordered ? 0.0 : flops_of(1) / median(ms[1]) * 1e-9;
  for (size_t i = 0; i < probs.size(); ++i) {
    const float med = median(ms[i]);
    const auto [lo, hi] = std::minmax_element(ms[i].begin(), ms[i].end());
    const double tflops = flops_of(i) / med * 1e-9;
    const BenchMask m = probs[i]->mask;
    printf("MASKS %s H=%d B=%d T=S=%d N=%d causal=%d mask=%s | sm90 %s median %.3f ms (%d rounds, %.3f-%.3f) "
           "%.1f TFLOP/s (useful FLOPs) | %.1f %% of plain %s",
           dt == DType::kBFloat16 ? "bf16" : "fp16", H, int(probs[i]->p.B), int(probs[i]->p.T), N, int(causal),
           bench_mask_name(m), backward ? "bwd" : "fwd", med, rounds, *lo, *hi, tflops, 100.0 * tflops / plain,
           causal ? "causal" : "non-causal");
    // Masks whose rows see T / 4 keys or so, also beside plain causal on T / 4.
    if (m == BenchMask::kWindow || m == BenchMask::kSegments || m == BenchMask::kQuarterWideWindow ||
        m == BenchMask::kQuarterOneSegment)
      printf(" | %.1f %% of plain(T/4)", 100.0 * tflops / plain_quarter);
    printf("\n");
    // JFA_BENCH_ROUNDS=1: every round's time too, in round order (is a wide min-max spread drift,
    // or two modes?).
    if (std::getenv("JFA_BENCH_ROUNDS")) {
      printf("ROUNDS %s H=%d mask=%s |", dt == DType::kBFloat16 ? "bf16" : "fp16", H, bench_mask_name(m));
      for (float t : ms[i]) printf(" %.3f", t);
      printf("\n");
    }
  }
  fflush(stdout);
  CK(cudaStreamDestroy(s));
}

// Host time of one forward call (descriptors, attributes, counter reset, launch) on a problem
// whose kernel takes a few microseconds, beside the CUDA calls it is made of: at T = 1k the GPU
// time per call is ~150 us, and through JAX the host's share per call adds to that when it runs dry.
static void host_cost() {
  AttentionParams p;
  p.B = 1; p.T = 64; p.S = 64; p.N = 1; p.K = 1; p.H = 128; p.Hv = 128; p.dtype = DType::kBFloat16;
  p.scale = 0.088f; p.scale_log2 = p.scale * 1.4426950408889634f;
  p.is_causal = true;
  p.tile_counter = tile_counter();
  void* bufs[4];
  for (auto& b : bufs) { CK(cudaMalloc(&b, 64 * 128 * 2)); CK(cudaMemset(b, 0, 64 * 128 * 2)); }
  float* lse;
  CK(cudaMalloc(&lse, 64 * 4));
  auto st = jfa::packed_strides(64, 1, 128);
  p.q = bufs[0]; p.k = bufs[1]; p.v = bufs[2]; p.o = bufs[3];
  p.q_strides = p.k_strides = p.v_strides = p.o_strides = st;
  p.lse = lse; p.lse_strides = jfa::Strides{64, 1, 1};
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  auto per_call_us = [&](auto&& fn) {
    for (int i = 0; i < 50; ++i) fn();
    CK(cudaStreamSynchronize(s));
    const int n = 2000;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) fn();
    const auto t1 = std::chrono::steady_clock::now();
    CK(cudaStreamSynchronize(s));
    return std::chrono::duration<double, std::micro>(t1 - t0).count() / n;
  };
  printf("HOST sm90 forward call: %.1f us\n", per_call_us([&] { CK(jfa::sm90::forward(p, s)); }));
  printf("HOST cudaMemsetAsync (4 bytes): %.1f us\n",
         per_call_us([&] { CK(cudaMemsetAsync(p.tile_counter, 0, 4, s)); }));
  printf("HOST cudaGetDriverEntryPointByVersion: %.1f us\n", per_call_us([&] {
           void* fn = nullptr;
           cudaDriverEntryPointQueryResult q;
           CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
         }));
  for (auto& b : bufs) CK(cudaFree(b));
  CK(cudaFree(lse));
  CK(cudaStreamDestroy(s));
}

// Paged caches (rows past the lengths and unused pages NaN). Small: decode-shaped calls on pages of
// a key tile or more, and on pages smaller than a tile or no multiple of it (loaded in chunks that
// may start inside a page), S not a multiple of the tile (the last tile's rows past the table come
// from its last page). Full, besides: decode-shaped, a few queries with ALiBi, many with a window
// and soft-capping, on pages of every size; without lengths (every row valid) too.
void add_paged_cases(std::vector<Config>& cases, int H, bool small) {
  const DType BF = DType::kBFloat16, FP = DType::kFloat16;
  const int paged = kPaged | kLengths;
  cases.push_back({2, 1, 512, 4, 1, H, true, BF, 0, paged | kBottomRight});
  cases.push_back({2, 17, 384, 4, 2, H, false, FP, 0, paged});
  cases.push_back({2, 3, 400, 4, 2, H, true, BF, 0, paged | kBottomRight, 16});
  cases.push_back({2, 1, 432, 8, 2, H, false, BF, 0, paged | kSoftcap, 48});
  cases.push_back({2, 2, 576, 4, 2, H, true, BF, 0, paged | kBottomRight, 192});  // wide chunks inside pages
  cases.push_back({1, 5, 320, 4, 1, H, true, BF, 0, paged | kBottomRight | kAlibi, 64});
  if (small) return;
  cases.push_back({3, 1, 1024, 8, 2, H, true, BF, 0, paged | kBottomRight});
  cases.push_back({2, 64, 768, 4, 2, H, true, FP, 0, paged | kBottomRight | kAlibi});
  cases.push_back({2, 300, 512, 4, 1, H, false, BF, 0, kPaged | kWindow | kSoftcap});
  cases.push_back({1, 200, 1280, 4, 4, H, true, BF, 0, paged | kSegments});
  cases.push_back({3, 1, 2000, 8, 2, H, true, BF, 0, paged | kBottomRight, 16});
  cases.push_back({2, 40, 960, 4, 2, H, true, FP, 0, paged | kBottomRight | kAlibi, 32});
  cases.push_back({1, 130, 1344, 4, 4, H, true, BF, 0, paged | kSegments, 64});
  cases.push_back({2, 300, 480, 4, 1, H, false, BF, 0, kPaged | kWindow | kSoftcap, 48});
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "--profile" && argc >= 4) {
    // Optional: a BenchMask by its number (BenchMask order) and T (B = 16k / T).
    const int H = std::atoi(argv[2]), T = argc >= 6 ? std::atoi(argv[5]) : 16384;
    const BenchMask m = argc >= 5 ? BenchMask(std::atoi(argv[4])) : BenchMask::kNone;
    bench(DType::kBFloat16, H, 16384 / T, T, 2048 / H, std::atoi(argv[3]) != 0, m);
    return 0;
  }
  if (mode == "--hostcost") {
    host_cost();
    return 0;
  }
  if (mode == "--lengths") {  // the sweep's lengths at B·T = 16k, for tile choices by length
    g_skip_sm80 = true;
    for (int H : {64, 128, 256})
      for (bool causal : {false, true})
        for (int T : {1024, 2048, 4096, 8192, 16384}) bench(DType::kBFloat16, H, 16384 / T, T, 2048 / H, causal);
    return 0;
  }
  const bool small = mode == "--small", masks_bwd = mode == "--masks-bwd", masks_only = mode == "--masks" || masks_bwd;
  const bool ordered_only = mode == "--deterministic-bwd";
  // --paged [H [page]]: the paged cases alone (sanitizers on a build of one head dim).
  const bool paged_only = mode == "--paged";
  const bool bench_only = mode == "--bench" || masks_only || ordered_only;
  const unsigned seed = std::random_device{}();
  printf("seed: %u\n", seed);
  std::mt19937 rng(seed);
  std::vector<Config> cases;
  const DType BF = DType::kBFloat16, FP = DType::kFloat16;
  if (paged_only) {
    for (int H : {64, 128, 256}) {
      if (argc > 2 && H != std::atoi(argv[2])) continue;
      add_paged_cases(cases, H, true);
    }
    if (argc > 3)  // one page size (racecheck takes minutes per case)
      cases.erase(std::remove_if(cases.begin(), cases.end(), [&](const Config& c) { return c.page != std::atoi(argv[3]); }),
                  cases.end());
  } else if (small) {
    for (int H : {64, 128, 256})
      for (bool causal : {false, true}) {
        cases.push_back({1, 17, 33, 2, 1, H, causal, BF, 0});
        cases.push_back({2, 200, 150, 2, 2, H, causal, FP, 8});
        cases.push_back({1, 1600, 2100, 2, 1, H, causal, BF, 0});  // past the short-sequence tiles
      }
    // More tiles (160) than SMs, so that CTAs run several: where O reuses Q's smem, the next tile's
    // Q waits for O's stores (fwd_epilogue.h).
    for (int H : {128, 256}) cases.push_back({1, 256, H == 128 ? 2200 : 600, 80, 8, H, false, BF, 0});
    cases.push_back({1, 256, 600, 80, 8, 256, true, BF, 0, kWindow});  // the general path's 128 x 64 tile
    for (int H : {64, 128, 256}) {  // the general (masked) path
      cases.push_back({1, 17, 33, 2, 1, H, true, BF, 0, kWindow | kBottomRight | kAlibi | kSoftcap});
      cases.push_back({2, 200, 150, 2, 2, H, false, FP, 8, kLengths | kSegments | kBias | kMask});
      cases.push_back({1, 1600, 2100, 2, 1, H, true, BF, 0, kWindow | kAlibi});  // H 64's 192-row tiles
      cases.push_back({1, 1700, 1700, 2, 1, H, true, BF, 0, kSegments});
      cases.push_back({1, 1700, 1700, 2, 1, H, true, BF, 0, kChunkAlignedSegments});
      cases.push_back({1, 1700, 2100, 2, 1, H, false, FP, 0, kScatteredSegments});
      cases.push_back({1, 300, 200, 2, 1, H, false, FP, 0, kWindow | kSteepAlibi});
      cases.push_back({1, 150, 200, 2, 1, H, true, BF, 0, kDropout});
    }
    for (int H : {64, 128, 256}) add_paged_cases(cases, H, true);
    // Head dims between the kernels' run on the next wider kernel (api.h, kernel_head_dim).
    for (int H : {32, 96, 192}) {
      cases.push_back({2, 200, 150, 2, 2, H, true, FP, 8});
      cases.push_back({1, 17, 33, 2, 1, H, false, BF, 0, kWindow | kAlibi | kSoftcap | kLengths});
    }
  } else if (!bench_only) {
    const int kAllPadded = kWindow | kBottomRight | kLengths | kSegments | kSoftcap | kAlibi | kBias | kMask;
    for (int H : {32, 96, 192})  // on the next wider kernel (api.h, kernel_head_dim)
      for (bool causal : {false, true}) {
        cases.push_back({2, 255, 1000, 8, 2, H, causal, BF, 0});
        cases.push_back({1, 2100, 2100, 2, 1, H, causal, FP, 8});
        cases.push_back({2, 300, 255, 4, 2, H, causal, BF, 0, kAllPadded});
        cases.push_back({1, 150, 200, 2, 1, H, causal, BF, 0, kDropout | kLengths});
      }
    const int TS[][2] = {{1, 1}, {17, 17}, {255, 255}, {17, 255}, {255, 17}, {1000, 255}, {1, 1000}, {255, 1}, {384, 384}};
    for (DType dt : {BF, FP})
      for (int H : {64, 128, 256})
        for (bool causal : {false, true})
          for (auto& ts : TS) cases.push_back({2, ts[0], ts[1], 2, 2, H, causal, dt, 0});
    for (int H : {64, 128, 256})
      for (bool causal : {false, true}) {
        cases.push_back({2, 255, 1000, 8, 2, H, causal, BF, 0});   // GQA
        cases.push_back({1, 1000, 255, 8, 1, H, causal, FP, 0});   // MQA
        cases.push_back({2, 255, 300, 4, 2, H, causal, BF, 8});    // non-packed strides
        cases.push_back({3, 1100, 1100, 16, 4, H, causal, BF, 0}); // many tiles per CTA (persistent)
        cases.push_back({2, 1100, 2300, 16, 4, H, causal, BF, 0}); // the same past the short-sequence tiles
        // Both sides of fwd_launch.h's short-sequence tile choice (T <= 1536 causal, S <= 2048 not).
        cases.push_back({1, 2100, 2100, 2, 1, H, causal, BF, 0});
        cases.push_back({1, 1500, 2100, 2, 1, H, causal, FP, 0});
      }
    const int kAll = kWindow | kBottomRight | kLengths | kSegments | kSoftcap | kAlibi | kBias | kMask;
    for (int H : {64, 128, 256}) {  // the general path: each feature, then combinations
      int i = 0;
      for (int f : std::initializer_list<int>{kWindow, kWindow | kBottomRight, kBottomRight, kLengths, kSegments,
                                              kSoftcap, kAlibi, kBias, kMask})
        cases.push_back({2, 255, 300, 4, 2, H, (i++ & 1) == 0, BF, 0, f});
      cases.push_back({2, 300, 255, 4, 2, H, true, BF, 0, kBottomRight | kLengths});  // T > S, bottom-right
      // ALiBi alone takes its term on the tensor cores (fwd_kernel.h, kAlibiPrefix): blocks left of,
      // right of and across the rows, both dtypes, fp16's fallback for a steep slope.
      cases.push_back({2, 255, 300, 4, 2, H, false, BF, 0, kAlibi});
      cases.push_back({2, 300, 1000, 4, 2, H, false, FP, 8, kAlibi | kWindow | kLengths});
      cases.push_back({1, 1000, 1700, 4, 2, H, true, FP, 0, kAlibi | kBottomRight});
      cases.push_back({2, 1700, 2100, 4, 2, H, false, FP, 0, kSteepAlibi | kBottomRight | kWindow});
      cases.push_back({1, 1700, 2100, 4, 1, H, true, BF, 0, kSteepAlibi});
      cases.push_back({2, 1000, 255, 8, 2, H, true, FP, 0, kAll});
      cases.push_back({3, 1100, 1100, 16, 4, H, true, BF, 0, kSegments | kAlibi | kLengths});
      // Segment ids alone past T = 1536: H 64's segment-ids kernel on its own tiles (fwd_launch.h),
      // packed at random boundaries and on 16-key chunks (where rows fold their segment into their
      // position bounds: mask.h, tile_rows), and scattered (tested per key).
      cases.push_back({2, 1700, 2100, 4, 2, H, true, BF, 0, kSegments | kLengths});
      cases.push_back({2, 2000, 2000, 4, 2, H, true, BF, 0, kScatteredSegments});
      cases.push_back({2, 1700, 1700, 4, 2, H, true, BF, 0, kChunkAlignedSegments | kLengths});
      cases.push_back({2, 1000, 1300, 4, 2, H, false, FP, 0, kChunkAlignedSegments | kAlibi | kWindow});
      cases.push_back({1, 1100, 1300, 4, 2, H, true, BF, 0, kChunkAlignedSegments | kDropout});
      cases.push_back({1, 2000, 1700, 4, 1, H, false, FP, 8, kScatteredSegments | kWindow | kBottomRight});
      // Past T = 1536 without segment ids: H 64's 192 x 112 general tiles (fwd_launch.h).
      cases.push_back({1, 1700, 2100, 4, 2, H, true, BF, 0, kWindow | kAlibi | kLengths | kSoftcap});
      cases.push_back({1, 2000, 1700, 4, 1, H, false, FP, 0, kBias | kMask | kBottomRight | kWindow});
      // Dropout (its own kernel): alone, with the positions, with everything.
      cases.push_back({2, 255, 300, 4, 2, H, false, BF, 0, kDropout});
      cases.push_back({2, 300, 255, 4, 2, H, true, FP, 8, kDropout | kLengths | kBottomRight});
      cases.push_back({1, 1100, 1300, 4, 2, H, true, BF, 0, kDropout | kAlibi | kSegments | kWindow});
      cases.push_back({2, 1000, 255, 8, 2, H, true, FP, 0, kAll | kDropout});
      add_paged_cases(cases, H, false);
    }
  }
  for (auto& c : cases) run_case(c, rng);
  if (!small && !paged_only && !masks_only && !ordered_only) {
    for (int H : {64, 128, 256})
      for (bool causal : {false, true}) bench(BF, H, 1, 16384, 2048 / H, causal);
  }
  if (masks_only)
    for (int H : {64, 128, 256}) bench_masks(BF, H, 16384, 2048 / H, 15, masks_bwd);
  if (ordered_only)
    for (int H : {64, 128, 256})
      for (bool causal : {true, false}) bench_masks(BF, H, 16384, 2048 / H, 9, true, true, causal);
  printf("%d failures\n", g_failures);
  return g_failures ? 1 : 0;
}
