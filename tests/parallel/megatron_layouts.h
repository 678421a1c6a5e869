// The layouts the Megatron suites (megatron_parity_test.cc, megatron_traffic_test.cc) run a
// case on, by the family the case was written for, at this world size W: tp=W, sp=W, or the
// 2-D meshes (tp=1,sp=1 at W = 1; tp=2,sp=1 and tp=1,sp=2 at W = 2; tp=2,sp=2 at W = 4;
// none otherwise).
#pragma once

#include <string>
#include <vector>

#include "layout/layout.h"
#include "mpi_test_main.h"

namespace foldpar::test {

enum class Family { kTp, kSp, kMesh };

// The Layout a layout string of these suites names, with `options` (":seqpar", ...) added.
inline Layout megatron_layout(const std::string& layout, const std::string& options = "") {
  return parse_layout(layout + options).value();
}

// ... with a case's knobs (any struct with split, exchange, overlap, recompute and
// sequence_parallel), so that the parity and traffic suites build their Layout alike.
template <class Knobs>
Layout megatron_layout_with(const std::string& layout, const Knobs& k) {
  Layout o = megatron_layout(layout);
  o.split = k.split;
  o.kv_exchange = k.exchange;
  o.overlap = k.overlap;
  o.recompute = k.recompute;
  o.sequence_parallel = k.sequence_parallel;
  return o;
}

inline std::vector<std::string> megatron_layouts(Family f) {
  const int W = mpi().world().size();
  switch (f) {
    case Family::kTp: return {"tp=" + std::to_string(W)};
    case Family::kSp: return {"sp=" + std::to_string(W)};
    case Family::kMesh:
      switch (W) {
        case 1: return {"tp=1,sp=1"};
        case 2: return {"tp=2,sp=1", "tp=1,sp=2"};
        case 4: return {"tp=2,sp=2"};
        default: return {};
      }
  }
  return {};
}

}  // namespace foldpar::test
