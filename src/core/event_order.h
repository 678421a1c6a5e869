// EventOrder: one program-order counter shared by the recorders of a dry run (the meta
// backend's op records, the counting communicators' starts and completions), so records
// from different streams merge into the order the program issued them. Passed in, never
// global. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>

namespace foldpar {

class EventOrder {
 public:
  // The next sequence number: 1, 2, 3, ...
  uint64_t next() { return next_.fetch_add(1, std::memory_order_relaxed) + 1; }
  // The latest number handed out (0 before any).
  uint64_t last() const { return next_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> next_{0};
};

}  // namespace foldpar
