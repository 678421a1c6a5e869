// The guarded backend: every op forwarded inside a GuardOpen window.
#include "backend/guarded_backend.h"

#include <string>

namespace foldpar {
namespace {

class GuardedBackend final : public Backend {
 public:
  GuardedBackend(Backend& inner, GuardedAllocator& guard)
      : inner_(inner), guard_(guard), name_(std::string("guarded ") + std::string(inner.name())) {}
  std::string_view name() const override { return name_; }

  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    GuardOpen w(&guard_);
    inner_.matmul(a, ta, b, tb, c, alpha, beta);
  }
  bool matmul_takes_bf16() const override { return inner_.matmul_takes_bf16(); }
  bool tokenwise_takes_bf16() const override { return inner_.tokenwise_takes_bf16(); }
  void copy(const Tensor& src, Tensor& dst) override {
    GuardOpen w(&guard_);
    inner_.copy(src, dst);
  }
  void add_inplace(const Tensor& x, Tensor& y) override {
    GuardOpen w(&guard_);
    inner_.add_inplace(x, y);
  }
  void scale_inplace(double alpha, Tensor& y) override {
    GuardOpen w(&guard_);
    inner_.scale_inplace(alpha, y);
  }
  void fill(double value, Tensor& y) override {
    GuardOpen w(&guard_);
    inner_.fill(value, y);
  }
  double sum_squares(const Tensor& x) override {
    GuardOpen w(&guard_);
    return inner_.sum_squares(x);
  }
  void copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) override {
    GuardOpen w(&guard_);
    inner_.copy_strided(src, dst, c);
  }
  void copy_from_host(std::span<const std::byte> src, Tensor& dst) override {
    GuardOpen w(&guard_);
    inner_.copy_from_host(src, dst);
  }
  void copy_to_host(const Tensor& src, std::span<std::byte> dst) override {
    GuardOpen w(&guard_);
    inner_.copy_to_host(src, dst);
  }
  void adamw_update(const AdamWStep& s, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) override {
    GuardOpen w(&guard_);
    inner_.adamw_update(s, grad, param, m, v);
  }
  void fill_many(double value, std::span<Tensor* const> ys) override {
    GuardOpen w(&guard_);
    inner_.fill_many(value, ys);
  }
  void sum_squares_many(std::span<const Tensor* const> xs, std::span<double> out) override {
    GuardOpen w(&guard_);
    inner_.sum_squares_many(xs, out);
  }
  void adamw_update_many(const AdamWStep& s, std::span<const AdamWTensors> ts) override {
    GuardOpen w(&guard_);
    inner_.adamw_update_many(s, ts);
  }
  void embedding_forward(const Tensor& ids, const Tensor& table, int64_t vocab_offset, Tensor& out) override {
    GuardOpen w(&guard_);
    inner_.embedding_forward(ids, table, vocab_offset, out);
  }
  void embedding_backward(const Tensor& ids, const Tensor& d_out, int64_t vocab_offset, Tensor& d_table) override {
    GuardOpen w(&guard_);
    inner_.embedding_backward(ids, d_out, vocab_offset, d_table);
  }
  void rmsnorm_forward(const Tensor& x, const Tensor& wt, double eps, Tensor& y, Tensor& rstd) override {
    GuardOpen w(&guard_);
    inner_.rmsnorm_forward(x, wt, eps, y, rstd);
  }
  void rmsnorm_backward(const Tensor& x, const Tensor& wt, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dw) override {
    GuardOpen w(&guard_);
    inner_.rmsnorm_backward(x, wt, rstd, dy, dx, dw);
  }
  void rope_forward(const Tensor& table, Tensor& x) override {
    GuardOpen w(&guard_);
    inner_.rope_forward(table, x);
  }
  void rope_backward(const Tensor& table, Tensor& dx) override {
    GuardOpen w(&guard_);
    inner_.rope_backward(table, dx);
  }
  void attention_forward(const AttentionArgs& args, Tensor& out, Tensor& lse) override {
    GuardOpen w(&guard_);
    inner_.attention_forward(args, out, lse);
  }
  void attention_backward(const AttentionArgs& args, const Tensor& out, const Tensor& lse, const Tensor& d_out,
                          Tensor& dq, Tensor& dk, Tensor& dv) override {
    GuardOpen w(&guard_);
    inner_.attention_backward(args, out, lse, d_out, dq, dk, dv);
  }
  void attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) override {
    GuardOpen w(&guard_);
    inner_.attention_merge(block_out, block_lse, out, lse);
  }
  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) override {
    GuardOpen w(&guard_);
    inner_.swiglu_forward(gate, up, out);
  }
  void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, Tensor& d_gate,
                       Tensor& d_up) override {
    GuardOpen w(&guard_);
    inner_.swiglu_backward(gate, up, d_out, d_gate, d_up);
  }
  double cross_entropy_forward(const Tensor& logits, const Tensor& targets, int32_t ignore_index,
                               Tensor& lse) override {
    GuardOpen w(&guard_);
    return inner_.cross_entropy_forward(logits, targets, ignore_index, lse);
  }
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t vocab_offset,
                              int32_t ignore_index, double grad_scale, Tensor& d_logits) override {
    GuardOpen w(&guard_);
    inner_.cross_entropy_backward(logits, targets, lse, vocab_offset, ignore_index, grad_scale, d_logits);
  }
  void softmax_chunk_update(const Tensor& logits, const Tensor& targets, int64_t vocab_offset, int32_t ignore_index,
                            Tensor& row_max, Tensor& row_sum, Tensor& target_logit) override {
    GuardOpen w(&guard_);
    inner_.softmax_chunk_update(logits, targets, vocab_offset, ignore_index, row_max, row_sum, target_logit);
  }
  void softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) override {
    GuardOpen w(&guard_);
    inner_.softmax_rescale(local_max, global_max, row_sum);
  }
  LossSums cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                const Tensor& targets, int32_t ignore_index, Tensor& lse) override {
    GuardOpen w(&guard_);
    return inner_.cross_entropy_finish(row_max, row_sum, target_logit, targets, ignore_index, lse);
  }
  int64_t count_valid_targets(const Tensor& targets, int32_t ignore_index) override {
    GuardOpen w(&guard_);
    return inner_.count_valid_targets(targets, ignore_index);
  }
  void moe_route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights,
                         Tensor& experts) override {
    GuardOpen w(&guard_);
    inner_.moe_route_forward(logits, normalize, probs, weights, experts);
  }
  void moe_route_backward(const MoeRouteGrad& g, Tensor& d_logits) override {
    GuardOpen w(&guard_);
    inner_.moe_route_backward(g, d_logits);
  }
  void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override {
    GuardOpen w(&guard_);
    inner_.gather_rows(src, rows, scale, dst);
  }
  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override {
    GuardOpen w(&guard_);
    inner_.scatter_add_rows(src, rows, scale, dst);
  }
  void rows_dot(const Tensor& a, const Tensor& b, Tensor& out) override {
    GuardOpen w(&guard_);
    inner_.rows_dot(a, b, out);
  }
  void sigmoid_forward(const Tensor& x, Tensor& y) override {
    GuardOpen w(&guard_);
    inner_.sigmoid_forward(x, y);
  }
  void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    GuardOpen w(&guard_);
    inner_.sigmoid_backward(y, dy, dx);
  }

 private:
  Backend& inner_;
  GuardedAllocator& guard_;
  std::string name_;
};

}  // namespace

std::unique_ptr<Backend> make_guarded_backend(Backend& inner, GuardedAllocator& guard) {
  return std::make_unique<GuardedBackend>(inner, guard);
}

}  // namespace foldpar
