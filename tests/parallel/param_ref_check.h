// What the parity tests check of a layout's ParamRefs (parallel/param_ref.h) against the
// single-rank model: each slice of every parameter and gradient a rank holds equals the
// block of the global tensor it names, so replicated copies (norm gains, the attention
// variants, KV replicas) are complete on every rank, not only where assembly reads them
// (megatron_parity_test.cc, pipeline_parity_test.cc). Not collective.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "core/tolerance.h"
#include "model/llama_weights.h"
#include "parallel/param_ref.h"
#include "tensor/compare.h"

namespace foldpar::test {

// The block of a global tensor that one GlobalSlice names, laid out as the local tensor
// holds it ([rows, cols], or [cols, rows] when transposed).
inline Tensor global_block(const Tensor& global, const GlobalSlice& s) {
  const int64_t C = global.dim(-1);
  Tensor out = Tensor::empty({s.rows * s.cols}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t c = 0; c < s.cols; ++c)
      out.data<float>()[s.transposed ? c * s.rows + r : r * s.cols + c] =
          global.data<float>()[(s.row0 + r) * C + s.col0 + c];
  return out;
}

// Every slice of every ParamRef: the gradient within kF32Parallel of the reference's block,
// the weight equal to it bit for bit; the slices cover each tensor exactly. Returns the
// elements this rank counts (ParamRef::counted).
inline int64_t expect_param_refs(const std::vector<ParamRef>& params, const LlamaWeights& ref_weights,
                                 const LlamaWeights& ref_grads, const std::string& where) {
  std::map<std::string, Tensor> weights, grads;
  ref_weights.for_each([&](const std::string& n, const Tensor& t) { weights[n] = t; });
  ref_grads.for_each([&](const std::string& n, const Tensor& t) { grads[n] = t; });
  int64_t counted = 0;
  for (const ParamRef& p : params) {
    if (p.counted) counted += p.param.numel();
    int64_t covered = 0;
    for (const GlobalSlice& s : p.slices) {
      EXPECT_TRUE(grads.count(s.tensor)) << s.tensor;
      if (!grads.count(s.tensor)) continue;
      const int64_t n = s.rows * s.cols;
      covered += n;
      const Tensor got_g = p.grad.reshape({p.grad.numel()}).narrow(s.offset, s.offset + n);
      const Tensor got_w = p.param.reshape({p.param.numel()}).narrow(s.offset, s.offset + n);
      const Tensor want_g = global_block(grads[s.tensor], s);
      EXPECT_LE(max_rel_error(got_g, want_g), tol::kF32Parallel)
          << where << ": " << p.name << " / " << s.tensor << "\n" << describe_mismatches(got_g, want_g, tol::kF32Parallel);
      EXPECT_EQ(max_rel_error(got_w, global_block(weights[s.tensor], s)), 0.0) << where << ": " << p.name << " / "
                                                                               << s.tensor;
    }
    EXPECT_EQ(covered, p.param.numel()) << where << ": " << p.name;
  }
  return counted;
}

}  // namespace foldpar::test
