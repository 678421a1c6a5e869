// WeightGradQueue: the weight-gradient GEMMs of a backward, held for later (the zero-bubble
// pipeline schedule, parallel/pipeline/: a micro-batch's backward split into B, the input
// gradient, and W, the weight gradients, run later to fill the pipeline's bubble).
// While a queue is attached to a BlockContext, the sub-blocks' weight-gradient products
// (linear_backward_weight's dW (+)= dy^T x and the MLP's gate/up products) are recorded with
// the tensors they read instead of being run; run() runs them in the recorded order. What is
// recorded must not change before run(): the operands are the backward's own fresh tensors
// and the saved activations (held here, so they outlive the saved state), the output a view
// of the gradient, which nothing else writes in between. Bias gradients (column sums of dy)
// are not queued: they stay in B (cheap, and strategies fold them into per-step partials).
// A strategy whose weight gradients travel after their products (TSP's reduce to the shard's
// owner and gradient ring, parallel/tsp/) queues that work too, as actions between the
// products, so W runs both in the recorded order.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "backend/backend.h"

namespace foldpar {

class WeightGradQueue {
 public:
  // c = a^(T?) b^(T?) + beta c, later. a, b: the products' operands; c: the gradient view.
  void push(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float beta);
  // `action` later, after the products pushed before it and before those pushed after it.
  // What it captures is held until run() (not counted by held_bytes: an action allocates
  // what it moves when it runs).
  void push_action(std::function<void()> action);
  // Runs every queued product and action in order and releases what they held.
  void run(Backend& backend);
  bool empty() const { return gemms_.empty(); }
  size_t size() const { return gemms_.size(); }
  // Bytes of the distinct operand tensors held (each storage once, by address): what deferring
  // W keeps alive beyond the backward.
  int64_t held_bytes() const;

 private:
  struct Gemm {
    Tensor a;
    bool trans_a = false;
    Tensor b;
    bool trans_b = false;
    Tensor c;
    float beta = 1.0f;
    std::function<void()> action;  // set: this entry is an action, not a product
  };
  std::vector<Gemm> gemms_;
};

}  // namespace foldpar
