// Decode attention's tasks dealt out to the threads by their cost (shared by cpu_attention.cpp and
// cpu_attention_amx.h).
//
// A task is a request with all its KV heads or, where that cannot keep the threads even, one (request, KV head).
// Its cost is its context (within the window). at::parallel_for over the tasks in batch order gave each thread a
// contiguous half of the batch: a step whose long requests sat together ran 1.5x slower than the same contexts
// spread out (32 requests, 4 of 2,400 tokens and 28 of 200, 2 threads), and a step's time then depended on where
// its long requests happened to lie, not only on its context. Here the costliest task goes first, each to the
// thread with the least work so far (longest processing time first: within 4/3 of the best split).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace batchrun {

struct TaskPlan {
  int64_t split;                 // tasks per request: 1 (whole requests) or its KV heads
  std::vector<int64_t> order;    // task ids (request x split + part), thread t's from offsets[t] to offsets[t + 1]
  std::vector<int64_t> offsets;  // threads + 1 entries

  int64_t threads() const { return static_cast<int64_t>(offsets.size()) - 1; }
};

// kTaskCost: a task's fixed cost in context positions (its query's setup, its output's normalisation).
constexpr int64_t kTaskCost = 32;

// starts (null: none): where each request's positions begin (cpu_attention.cpp's starts).
inline TaskPlan balance_tasks(const int64_t* lens, int64_t batch, int64_t kv_heads, int64_t window,
                              int64_t threads = at::get_num_threads(), const int64_t* starts = nullptr) {
  threads = std::max<int64_t>(1, threads);
  auto context = [&](int64_t b) {
    const int64_t read = lens[b] - (starts != nullptr ? starts[b] : 0);
    return window > 0 ? std::min(read, window) : read;
  };
  int64_t total = 0, longest = 0;
  for (int64_t b = 0; b < batch; ++b) total += context(b), longest = std::max(longest, context(b));
  // whole requests read their blocks as contiguous runs; split them where there are too few for the threads or
  // one request alone is more than a thread's share
  const bool whole = batch >= 2 * threads && longest * threads <= total;
  TaskPlan plan{whole ? 1 : kv_heads, {}, std::vector<int64_t>(threads + 1, 0)};
  const int64_t tasks = batch * plan.split;
  auto cost = [&](int64_t task) { return context(task / plan.split) / plan.split + kTaskCost; };
  std::vector<int64_t> by_cost(tasks), owner(tasks), load(threads, 0);
  std::iota(by_cost.begin(), by_cost.end(), 0);
  std::stable_sort(by_cost.begin(), by_cost.end(), [&](int64_t x, int64_t y) { return cost(x) > cost(y); });
  for (const int64_t task : by_cost) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    owner[task] = t;
    load[t] += cost(task);
    ++plan.offsets[t + 1];
  }
  std::partial_sum(plan.offsets.begin(), plan.offsets.end(), plan.offsets.begin());
  plan.order.resize(tasks);
  std::vector<int64_t> next(plan.offsets.begin(), plan.offsets.end() - 1);
  for (int64_t task = 0; task < tasks; ++task) plan.order[next[owner[task]]++] = task;   // batch order per thread
  return plan;
}

}  // namespace batchrun
