// The plan's view of a layout: which allocation replay and traffic formulas apply. The
// Megatron strategies still differ by which of their axes exceed 1 (make_sharded_model picks
// the same way); everything else about a layout is layout/layout.h.
#pragma once

#include "layout/layout.h"

namespace foldpar {

enum class PlanStrategy { kTsp, kTp, kSp, kTpSp };

inline PlanStrategy plan_strategy(const Layout& l) {
  if (l.strategy == Strategy::kTsp) return PlanStrategy::kTsp;
  if (l.tp > 1 && l.sp > 1) return PlanStrategy::kTpSp;
  return l.sp > 1 ? PlanStrategy::kSp : PlanStrategy::kTp;
}

}  // namespace foldpar
