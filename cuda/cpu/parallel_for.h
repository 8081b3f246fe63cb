// A minimal thread pool substitute: std::thread workers pulling items from an atomic counter.
#pragma once

#include <cstdint>
#include <functional>

namespace jfa::cpu {

// Threads to use for `num_items` items: min(hardware threads, items), or JFA_CPU_THREADS if set.
int num_threads_for(int64_t num_items);

// Calls fn(thread, item) for every item in [0, num_items) on num_threads_for(num_items) threads
// (the caller's thread is thread 0). Items are handed out one at a time in increasing order, so
// callers put the most expensive items first for balance. thread < num_threads_for(num_items).
void parallel_for(int64_t num_items, const std::function<void(int thread, int64_t item)>& fn);

}  // namespace jfa::cpu
