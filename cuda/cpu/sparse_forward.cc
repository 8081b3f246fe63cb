// CPU forward of top-k sparse attention and attn_dist: one work item per query position, which
// loads each selected key row once for all the query heads that share it.
#include <cmath>
#include <limits>
#include <vector>

#include "parallel_for.h"
#include "sparse_attention.h"
#include "sparse_rows.h"

namespace jfa::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// logits[g * topk + j] = scale · q_g·k[indices[j]] for the G heads of key/value head kh at (b, t),
// -inf for invalid slots; valid[j] says which slots are valid.
void group_logits(const SparseParams& p, int64_t b, int64_t t, int64_t kh, const float* q, float* key,
                  float* logits, std::vector<char>& valid) {
  const int64_t G = p.group_size();
  const int32_t* indices = p.indices + p.index_row(b, t, kh);
  for (int64_t j = 0; j < p.topk; ++j) {
    valid[j] = sparse_index_valid(p, t, indices[j]);
    if (!valid[j]) {
      for (int64_t g = 0; g < G; ++g) logits[g * p.topk + j] = kNegInf;
      continue;
    }
    load_key_row(p, b, indices[j], kh, key);
    for (int64_t g = 0; g < G; ++g) logits[g * p.topk + j] = p.scale * dot(q + g * p.H, key, p.H);
  }
}

// Softmax of each head's logits in place (P), its LSE; a head with no valid slot gets lse -inf.
void softmax_rows(const SparseParams& p, float* logits, float* lse) {
  for (int64_t g = 0; g < p.group_size(); ++g) {
    float* row = logits + g * p.topk;
    float m = kNegInf;
    for (int64_t j = 0; j < p.topk; ++j) m = std::fmax(m, row[j]);
    if (m == kNegInf) {
      for (int64_t j = 0; j < p.topk; ++j) row[j] = 0.f;
      lse[g] = kNegInf;
      continue;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < p.topk; ++j) {
      row[j] = row[j] == kNegInf ? 0.f : std::exp(row[j] - m);
      sum += row[j];
    }
    for (int64_t j = 0; j < p.topk; ++j) row[j] /= sum;
    lse[g] = m + std::log(sum);
  }
}

}  // namespace

void sparse_forward(const SparseParams& p) {
  const int64_t G = p.group_size();
  parallel_for(p.B * p.T, [&](int, int64_t item) {
    const int64_t b = item / p.T, t = item % p.T;
    std::vector<float> q(G * p.H), key(p.H), value(p.Hv), probs(G * p.topk), out(G * p.Hv), lse(G);
    std::vector<char> valid(p.topk);
    for (int64_t kh = 0; kh < p.K; ++kh) {
      load_query_group(p, p.q, p.H, b, t, kh, q.data());
      group_logits(p, b, t, kh, q.data(), key.data(), probs.data(), valid);
      softmax_rows(p, probs.data(), lse.data());
      std::fill(out.begin(), out.end(), 0.f);
      const int32_t* indices = p.indices + p.index_row(b, t, kh);
      for (int64_t j = 0; j < p.topk; ++j) {
        if (!valid[j]) continue;
        load_value_row(p, b, indices[j], kh, value.data());
        for (int64_t g = 0; g < G; ++g) {
          const float pj = probs[g * p.topk + j];
          for (int64_t c = 0; c < p.Hv; ++c) out[g * p.Hv + c] += pj * value[c];
        }
      }
      const int64_t head0 = (b * p.T + t) * p.N + kh * G;
      store_dense_rows(p.o, p.dtype, p.Hv, head0, G, out.data());
      for (int64_t g = 0; g < G; ++g) p.lse[head0 + g] = lse[g];
    }
  });
}

void attn_dist(const SparseParams& p) {
  const int64_t G = p.group_size(), groups = p.N / p.head_group;
  std::fill(p.dist, p.dist + p.B * groups * p.T * p.topk, 0.f);
  parallel_for(p.B * p.T, [&](int, int64_t item) {
    const int64_t b = item / p.T, t = item % p.T;
    std::vector<float> q(G * p.H), key(p.H), logits(G * p.topk);
    std::vector<char> valid(p.topk);
    for (int64_t kh = 0; kh < p.K; ++kh) {
      load_query_group(p, p.q, p.H, b, t, kh, q.data());
      group_logits(p, b, t, kh, q.data(), key.data(), logits.data(), valid);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t n = kh * G + g;
        const float lse = p.lse[p.stat(b, t, n)];
        if (lse == kNegInf) continue;  // the row saw no key: nothing to distribute
        float* dist = p.dist + ((b * groups + n / p.head_group) * p.T + t) * p.topk;
        for (int64_t j = 0; j < p.topk; ++j)
          if (valid[j]) dist[j] += std::exp(logits[g * p.topk + j] - lse);
      }
    }
  });
}

}  // namespace jfa::cpu
