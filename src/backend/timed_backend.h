// TimedBackend: a Backend decorator that forwards every op to another backend and adds up
// wall time and call counts per op, for profiles (`foldpar bench --profile`). It changes no
// result. Not thread-safe.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "backend/backend.h"

namespace foldpar {

struct OpTime {
  double seconds = 0;
  int64_t calls = 0;
};

class TimedBackend final : public Backend {
 public:
  explicit TimedBackend(Backend& inner) : inner_(inner) {}
  std::string_view name() const override { return inner_.name(); }
  const std::map<std::string, OpTime>& times() const { return times_; }
  void reset() { times_.clear(); }

  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override;
  void copy(const Tensor& src, Tensor& dst) override;
  void copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) override;
  void copy_from_host(std::span<const std::byte> src, Tensor& dst) override;
  void copy_to_host(const Tensor& src, std::span<std::byte> dst) override;
  void add_inplace(const Tensor& x, Tensor& y) override;
  void scale_inplace(double alpha, Tensor& y) override;
  void fill(double value, Tensor& y) override;
  double sum_squares(const Tensor& x) override;
  void adamw_update(const AdamWStep& s, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) override;
  void fill_many(double value, std::span<Tensor* const> ys) override;
  void sum_squares_many(std::span<const Tensor* const> xs, std::span<double> out) override;
  void adamw_update_many(const AdamWStep& s, std::span<const AdamWTensors> ts) override;
  void embedding_forward(const Tensor& ids, const Tensor& table, int64_t vocab_offset, Tensor& out) override;
  void embedding_backward(const Tensor& ids, const Tensor& d_out, int64_t vocab_offset, Tensor& d_table) override;
  void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) override;
  void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dw) override;
  void rope_forward(const Tensor& table, Tensor& x) override;
  void rope_backward(const Tensor& table, Tensor& dx) override;
  void attention_forward(const AttentionArgs& args, Tensor& out, Tensor& lse) override;
  void attention_backward(const AttentionArgs& args, const Tensor& out, const Tensor& lse, const Tensor& d_out,
                          Tensor& dq, Tensor& dk, Tensor& dv) override;
  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, Tensor& d_gate,
                       Tensor& d_up) override;
  double cross_entropy_forward(const Tensor& logits, const Tensor& targets, int32_t ignore_index,
                               Tensor& lse) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t vocab_offset,
                              int32_t ignore_index, double grad_scale, Tensor& d_logits) override;
  void softmax_chunk_update(const Tensor& logits, const Tensor& targets, int64_t vocab_offset, int32_t ignore_index,
                            Tensor& row_max, Tensor& row_sum, Tensor& target_logit) override;
  void attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) override;
  void softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) override;
  LossSums cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                const Tensor& targets, int32_t ignore_index, Tensor& lse) override;
  int64_t count_valid_targets(const Tensor& targets, int32_t ignore_index) override;
  void moe_route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights,
                         Tensor& experts) override;
  void moe_route_backward(const MoeRouteGrad& g, Tensor& d_logits) override;
  void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override;
  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override;
  void rows_dot(const Tensor& a, const Tensor& b, Tensor& out) override;
  void sigmoid_forward(const Tensor& x, Tensor& y) override;
  void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override;

 private:
  template <typename Fn>
  auto timed(const char* op, Fn&& fn);

  Backend& inner_;
  std::map<std::string, OpTime> times_;
};

}  // namespace foldpar
