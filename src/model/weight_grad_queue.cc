// WeightGradQueue (weight_grad_queue.h).
#include "model/weight_grad_queue.h"

#include <set>

namespace foldpar {

void WeightGradQueue::push(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float beta) {
  gemms_.push_back(Gemm{a, trans_a, b, trans_b, c, beta, {}});
}

void WeightGradQueue::push_action(std::function<void()> action) {
  Gemm g;
  g.action = std::move(action);
  gemms_.push_back(std::move(g));
}

void WeightGradQueue::run(Backend& be) {
  for (Gemm& g : gemms_) {
    if (g.action) g.action();
    else be.matmul(g.a, g.trans_a, g.b, g.trans_b, g.c, 1.0f, g.beta);
  }
  gemms_.clear();
}

int64_t WeightGradQueue::held_bytes() const {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const Gemm& g : gemms_)
    for (const Tensor* t : {&g.a, &g.b})
      if (t->defined() && seen.insert(t->raw_data()).second) bytes += static_cast<int64_t>(t->nbytes());
  return bytes;
}

}  // namespace foldpar
