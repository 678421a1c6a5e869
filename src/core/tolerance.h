// The project's one tolerance policy. Errors are normwise relative: max_i |a_i - b_i| /
// max_i |b_i| over a whole tensor (b the reference), which is robust to elements near zero.
// Each bound says where it comes from; tests and `foldpar verify` use these, nothing else.
#pragma once

namespace foldpar::tol {

// A fast f32 op against the fp64-accumulating reference. f32 rounding is 6e-8 per operation;
// a dot product of length K accumulates about sqrt(K) of that in sgemm's blocked order and
// up to K for sequential sums, and exp/sigmoid add 2 ulp. K reaches a few thousand in tests.
constexpr double kF32Op = 2e-5;

// A whole model's loss, logits and gradients in f32 (fast backend) against the same model in
// f32 on the reference backend, or against PyTorch in fp64. Op errors compound through the
// blocks and the softmaxes; with the configs in configs/ at S <= 512 observed errors stay
// near 1e-5, so 1e-4 leaves a margin of about 10 without hiding a wrong formula (a wrong
// formula shows errors of order 1).
constexpr double kF32Model = 1e-4;

// A parallel layout's loss, logits and gradients in f32 against the single-rank model in
// f32 on the same backend. Only the order of summation differs (partial outputs accumulate
// shard by shard, gradients are summed over ranks), which moves results by a few ulp per
// sum; observed errors stay near 1e-6 on the parity configs.
constexpr double kF32Parallel = 1e-5;

// fp64 finite differences with central step 1e-6 on O(1) values: truncation error ~ eps^2
// = 1e-12 times the third derivative, rounding ~ 1e-16 / 1e-6 = 1e-10; 1e-6 is far above both.
constexpr double kF64FiniteDifference = 1e-6;
constexpr double kFiniteDifferenceStep = 1e-6;

}  // namespace foldpar::tol
