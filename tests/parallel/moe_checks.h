// Checks the MoE parity tests share (tsp_moe_parity_test, megatron_moe_parity_test): the
// negative control of expert parallelism over dp replicas, and the assembled weights against
// the single-rank model's. Not collective (assembly, done by the caller, is).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "core/tolerance.h"
#include "model/llama_weights.h"
#include "tensor/compare.h"

namespace foldpar::test {

// The largest relative error of any routed expert's gradient ("...experts.j...") in
// `assembled` against `reference` (name, tensor) in the same order. The negative control
// (expert gradients summed over the whole dp axis, not over their replicas) must make it far
// exceed the parity tolerance.
inline void expect_experts_off(LlamaWeights& assembled, const std::vector<std::pair<std::string, Tensor>>& reference) {
  double worst = 0;
  size_t n = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    if (name.find(".experts.") != std::string::npos) worst = std::max(worst, max_rel_error(t, reference[n].second));
    ++n;
  });
  EXPECT_GT(worst, 10 * tol::kF32Parallel);
}

// Every assembled weight equals the single-rank model's `reference` exactly (each expert from
// its owner, over the expert group's replicas too).
inline void expect_weights_exact(LlamaWeights& assembled, LlamaWeights& reference) {
  std::vector<Tensor> ref;
  reference.for_each([&](const std::string&, Tensor& t) { ref.push_back(t); });
  size_t j = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) { EXPECT_EQ(max_rel_error(t, ref[j++]), 0.0) << name; });
}

}  // namespace foldpar::test
