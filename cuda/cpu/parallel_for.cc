#include "parallel_for.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

namespace jfa::cpu {

int num_threads_for(int64_t num_items) {
  int64_t threads = std::max(1u, std::thread::hardware_concurrency());
  if (const char* env = std::getenv("JFA_CPU_THREADS")) {
    const long requested = std::strtol(env, nullptr, 10);
    if (requested > 0) threads = requested;
  }
  return static_cast<int>(std::max<int64_t>(1, std::min(threads, num_items)));
}

void parallel_for(int64_t num_items, const std::function<void(int, int64_t)>& fn) {
  if (num_items <= 0) return;
  const int num_threads = num_threads_for(num_items);
  // Dynamic hand-out: causal items differ in cost, so a static split would leave threads idle.
  std::atomic<int64_t> next{0};
  auto work = [&](int thread) {
    for (int64_t item = next.fetch_add(1); item < num_items; item = next.fetch_add(1)) fn(thread, item);
  };
  std::vector<std::thread> helpers;
  helpers.reserve(num_threads - 1);
  for (int t = 1; t < num_threads; ++t) helpers.emplace_back(work, t);
  work(0);
  for (auto& helper : helpers) helper.join();
}

}  // namespace jfa::cpu
