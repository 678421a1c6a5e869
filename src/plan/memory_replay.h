// Internal to plan/: the ledger the memory model replays allocations into, and the replay
// of each strategy family (tsp_memory.cc: tsp=D; tpsp_memory.cc: tp, sp and tp x sp). A
// replay adds every tensor that outlives a phase where the strategy's code allocates it and
// removes it where the code drops it; what lives only inside a phase is added and removed
// around the phase's highest point. The ledger keeps the highest total and its breakdown.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "plan/memory_model.h"

namespace foldpar::plan_detail {

inline constexpr MemCategory kP = MemCategory::kParameters, kG = MemCategory::kGradients,
                             kA = MemCategory::kActivations, kC = MemCategory::kComm,
                             kW = MemCategory::kWorkspace, kK = MemCategory::kKvCache;

class Ledger {
 public:
  void add(MemCategory c, int64_t bytes) {
    live_[static_cast<int>(c)] += bytes;
    int64_t total = 0;
    for (int64_t b : live_) total += b;
    if (total > peak_) {
      peak_ = total;
      at_peak_ = live_;
      peak_phase_ = phase_;
    }
  }
  void sub(MemCategory c, int64_t bytes) { live_[static_cast<int>(c)] -= bytes; }
  // A buffer that lives only for the moment being looked at.
  void touch(MemCategory c, int64_t bytes) {
    add(c, bytes);
    sub(c, bytes);
  }
  void phase(std::string p) { phase_ = std::move(p); }
  MemoryEstimate result() const {
    MemoryEstimate e;
    e.at_peak = at_peak_;
    e.peak = peak_;
    e.phase = peak_phase_;
    return e;
  }

 private:
  std::array<int64_t, kNumMemCategories> live_{}, at_peak_{};
  int64_t peak_ = 0;
  std::string phase_, peak_phase_;
};

// A group of allocations added together and removed together (bytes per category).
struct Bundle {
  std::array<int64_t, kNumMemCategories> bytes{};
  void put(MemCategory c, int64_t b) { bytes[static_cast<int>(c)] += b; }
  void add_to(Ledger& led) const {
    for (int i = 0; i < kNumMemCategories; ++i)
      if (bytes[i] != 0) led.add(static_cast<MemCategory>(i), bytes[i]);
  }
  void sub_from(Ledger& led) const {
    for (int i = 0; i < kNumMemCategories; ++i)
      if (bytes[i] != 0) led.sub(static_cast<MemCategory>(i), bytes[i]);
  }
};

// The scratch of one flash-attention call (backend/cpu/flash_attention.cc make_plan): q, acc
// (and dq) row blocks, score blocks, row vectors, per-head K/V copies when the tensors hold
// several KV heads, and the key-block ranges. sq, sk: query and key positions per sequence.
int64_t flash_workspace(int64_t sq, int64_t sk, int64_t heads, int64_t kv_heads, int64_t d, bool backward);

// One step of `request.mode` (train, forward, prefill) after the parameters (and gradients)
// are in the ledger; kv_cache_bytes (prefill) is added with the step's constants.
void replay_tsp(const LlamaConfig& config, const Layout& layout, const MemoryRequest& request,
                int64_t kv_cache_bytes, Ledger& ledger);
void replay_tp_sp(const LlamaConfig& config, const Layout& layout, const MemoryRequest& request,
                  int64_t kv_cache_bytes, Ledger& ledger);

}  // namespace foldpar::plan_detail
