// CPU backward of top-k sparse attention, deterministic and without atomics, per block of query
// rows in three passes:
//   1. per query position (parallel): P and dS of every (head, slot) from the saved LSE, and dQ;
//   2. per (batch, key/value head, range of key rows) (parallel): dK and dV of the rows it owns,
//      summed in (query, slot, head) order into float32 accumulators;
// then the accumulators are rounded into dk and dv once. The per-block P/dS scratch keeps memory
// bounded whatever T is.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "parallel_for.h"
#include "sparse_attention.h"
#include "sparse_rows.h"

namespace jfa::cpu {
namespace {

constexpr int64_t kScratchFloats = int64_t{8} << 20;  // P and dS of one block of query positions

struct Scratch {
  int64_t row0 = 0, rows = 0;  // flattened query positions b * T + t in this block
  std::vector<float> probs, dscores;  // [rows, K, G, topk]: P and scale · dS (0 for invalid slots)
  float* probs_at(const SparseParams& p, int64_t row, int64_t kh) {
    return probs.data() + ((row - row0) * p.K + kh) * p.group_size() * p.topk;
  }
  float* dscores_at(const SparseParams& p, int64_t row, int64_t kh) {
    return dscores.data() + ((row - row0) * p.K + kh) * p.group_size() * p.topk;
  }
};

// Pass 1 for query position (b, t): P, scale · dS and dQ of each of its heads.
void query_gradients(const SparseParams& p, int64_t b, int64_t t, Scratch& scratch) {
  const int64_t G = p.group_size();
  std::vector<float> q(G * p.H), dout(G * p.Hv), out(G * p.Hv), key(p.H), value(p.Hv), dq(G * p.H);
  std::vector<float> softmax_d(G);
  const int64_t row = b * p.T + t;
  for (int64_t kh = 0; kh < p.K; ++kh) {
    load_query_group(p, p.q, p.H, b, t, kh, q.data());
    load_query_group(p, p.dout, p.Hv, b, t, kh, dout.data());
    load_query_group(p, p.o, p.Hv, b, t, kh, out.data());
    const int64_t head0 = p.stat(b, t, kh * G);
    // D = rowsum(dO∘O) − dLSE: the LSE's cotangent enters the softmax backward here.
    for (int64_t g = 0; g < G; ++g)
      softmax_d[g] = dot(dout.data() + g * p.Hv, out.data() + g * p.Hv, p.Hv) - p.dlse[head0 + g];
    std::fill(dq.begin(), dq.end(), 0.f);
    float* probs = scratch.probs_at(p, row, kh);
    float* dscores = scratch.dscores_at(p, row, kh);
    const int32_t* indices = p.indices + p.index_row(b, t, kh);
    for (int64_t j = 0; j < p.topk; ++j) {
      const bool valid = sparse_index_valid(p, t, indices[j]);
      if (valid) {
        load_key_row(p, b, indices[j], kh, key.data());
        load_value_row(p, b, indices[j], kh, value.data());
      }
      for (int64_t g = 0; g < G; ++g) {
        float prob = 0.f, dscore = 0.f;
        if (valid) {
          prob = std::exp(p.scale * dot(q.data() + g * p.H, key.data(), p.H) - p.lse[head0 + g]);
          dscore = p.scale * prob * (dot(dout.data() + g * p.Hv, value.data(), p.Hv) - softmax_d[g]);
          for (int64_t c = 0; c < p.H; ++c) dq[g * p.H + c] += dscore * key[c];
        }
        probs[g * p.topk + j] = prob;
        dscores[g * p.topk + j] = dscore;
      }
    }
    store_dense_rows(p.dq, p.dtype, p.H, head0, G, dq.data());
  }
}

// Pass 2 for key rows [s0, s1) of (b, kh): adds every selection of those rows in the block.
void key_gradients(const SparseParams& p, int64_t b, int64_t kh, int64_t s0, int64_t s1, Scratch& scratch,
                   float* dk_acc, float* dv_acc) {
  const int64_t G = p.group_size();
  std::vector<float> q(G * p.H), dout(G * p.Hv);
  const int64_t first = std::max(scratch.row0, b * p.T), last = std::min(scratch.row0 + scratch.rows, (b + 1) * p.T);
  for (int64_t row = first; row < last; ++row) {
    const int64_t t = row - b * p.T;
    const int32_t* indices = p.indices + p.index_row(b, t, kh);
    bool loaded = false;
    const float* probs = scratch.probs_at(p, row, kh);
    const float* dscores = scratch.dscores_at(p, row, kh);
    for (int64_t j = 0; j < p.topk; ++j) {
      const int32_t s = indices[j];
      if (s < s0 || s >= s1 || !sparse_index_valid(p, t, s)) continue;
      if (!loaded) {
        load_query_group(p, p.q, p.H, b, t, kh, q.data());
        load_query_group(p, p.dout, p.Hv, b, t, kh, dout.data());
        loaded = true;
      }
      float* dk = dk_acc + p.k_row(b, s, kh);
      float* dv = p.v ? dv_acc + p.v_row(b, s, kh) : dk;  // V = K[..., :Hv]: one gradient buffer
      for (int64_t g = 0; g < G; ++g) {
        const float dscore = dscores[g * p.topk + j], prob = probs[g * p.topk + j];
        for (int64_t c = 0; c < p.H; ++c) dk[c] += dscore * q[g * p.H + c];
        for (int64_t c = 0; c < p.Hv; ++c) dv[c] += prob * dout[g * p.Hv + c];
      }
    }
  }
}

}  // namespace

void sparse_backward(const SparseParams& p) {
  const int64_t G = p.group_size();
  std::vector<float> dk_acc(p.B * p.S * p.K * p.H, 0.f), dv_acc(p.v ? p.B * p.S * p.K * p.Hv : 0, 0.f);
  const int64_t per_row = std::max<int64_t>(1, p.K * G * p.topk);
  const int64_t block_rows = std::max<int64_t>(1, kScratchFloats / per_row);
  const int64_t chunks = std::min<int64_t>(p.S, 4 * num_threads_for(p.B * p.K * p.S));
  const int64_t chunk_rows = (p.S + chunks - 1) / chunks;
  Scratch scratch;
  for (int64_t row0 = 0; row0 < p.B * p.T; row0 += block_rows) {
    scratch.row0 = row0;
    scratch.rows = std::min(block_rows, p.B * p.T - row0);
    scratch.probs.resize(scratch.rows * per_row);
    scratch.dscores.resize(scratch.rows * per_row);
    parallel_for(scratch.rows, [&](int, int64_t item) {
      const int64_t row = row0 + item;
      query_gradients(p, row / p.T, row % p.T, scratch);
    });
    parallel_for(p.B * p.K * chunks, [&](int, int64_t item) {
      const int64_t chunk = item % chunks, bk = item / chunks;
      const int64_t s0 = chunk * chunk_rows, s1 = std::min(p.S, s0 + chunk_rows);
      if (s0 < s1) key_gradients(p, bk / p.K, bk % p.K, s0, s1, scratch, dk_acc.data(), dv_acc.data());
    });
  }
  store_dense_rows(p.dk, p.dtype, p.H, 0, p.B * p.S * p.K, dk_acc.data());
  if (p.v) store_dense_rows(p.dv, p.dtype, p.Hv, 0, p.B * p.S * p.K, dv_acc.data());
}

}  // namespace jfa::cpu
