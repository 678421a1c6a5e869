// TimedBackend: forward and time.
#include "backend/timed_backend.h"

#include <chrono>

namespace foldpar {

template <typename Fn>
auto TimedBackend::timed(const char* op, Fn&& fn) {
  struct Stop {
    OpTime& slot;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~Stop() {
      slot.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ++slot.calls;
    }
  } stop{times_[op]};
  return fn();
}

void TimedBackend::matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
  timed("matmul", [&] { inner_.matmul(a, ta, b, tb, c, alpha, beta); });
}
void TimedBackend::copy(const Tensor& src, Tensor& dst) {
  timed("copy", [&] { inner_.copy(src, dst); });
}
void TimedBackend::add_inplace(const Tensor& x, Tensor& y) {
  timed("add_inplace", [&] { inner_.add_inplace(x, y); });
}
void TimedBackend::scale_inplace(double alpha, Tensor& y) {
  timed("scale_inplace", [&] { inner_.scale_inplace(alpha, y); });
}
void TimedBackend::fill(double value, Tensor& y) {
  timed("fill", [&] { inner_.fill(value, y); });
}
void TimedBackend::adamw_update(const AdamWStep& s, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) {
  timed("adamw_update", [&] { inner_.adamw_update(s, grad, param, m, v); });
}
double TimedBackend::sum_squares(const Tensor& x) {
  return timed("sum_squares", [&] { return inner_.sum_squares(x); });
}
void TimedBackend::fill_many(double value, std::span<Tensor* const> ys) {
  timed("fill_many", [&] { inner_.fill_many(value, ys); });
}
void TimedBackend::sum_squares_many(std::span<const Tensor* const> xs, std::span<double> out) {
  timed("sum_squares_many", [&] { inner_.sum_squares_many(xs, out); });
}
void TimedBackend::adamw_update_many(const AdamWStep& s, std::span<const AdamWTensors> ts) {
  timed("adamw_update_many", [&] { inner_.adamw_update_many(s, ts); });
}
void TimedBackend::embedding_forward(const Tensor& ids, const Tensor& table, int64_t off, Tensor& out) {
  timed("embedding_forward", [&] { inner_.embedding_forward(ids, table, off, out); });
}
void TimedBackend::embedding_backward(const Tensor& ids, const Tensor& d_out, int64_t off, Tensor& d_table) {
  timed("embedding_backward", [&] { inner_.embedding_backward(ids, d_out, off, d_table); });
}
void TimedBackend::rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  timed("rmsnorm_forward", [&] { inner_.rmsnorm_forward(x, w, eps, y, rstd); });
}
void TimedBackend::rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                                    Tensor& dx, Tensor& dw) {
  timed("rmsnorm_backward", [&] { inner_.rmsnorm_backward(x, w, rstd, dy, dx, dw); });
}
void TimedBackend::rope_forward(const Tensor& table, Tensor& x) {
  timed("rope_forward", [&] { inner_.rope_forward(table, x); });
}
void TimedBackend::rope_backward(const Tensor& table, Tensor& dx) {
  timed("rope_backward", [&] { inner_.rope_backward(table, dx); });
}
void TimedBackend::attention_forward(const AttentionArgs& args, Tensor& out, Tensor& lse) {
  timed("attention_forward", [&] { inner_.attention_forward(args, out, lse); });
}
void TimedBackend::attention_backward(const AttentionArgs& args, const Tensor& out, const Tensor& lse,
                                      const Tensor& d_out, Tensor& dq, Tensor& dk, Tensor& dv) {
  timed("attention_backward", [&] { inner_.attention_backward(args, out, lse, d_out, dq, dk, dv); });
}
void TimedBackend::swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  timed("swiglu_forward", [&] { inner_.swiglu_forward(gate, up, out); });
}
void TimedBackend::swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, Tensor& d_gate,
                                   Tensor& d_up) {
  timed("swiglu_backward", [&] { inner_.swiglu_backward(gate, up, d_out, d_gate, d_up); });
}
double TimedBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets, int32_t ignore_index,
                                           Tensor& lse) {
  return timed("cross_entropy_forward", [&] { return inner_.cross_entropy_forward(logits, targets, ignore_index, lse); });
}
void TimedBackend::cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                          int64_t vocab_offset, int32_t ignore_index, double grad_scale,
                                          Tensor& d_logits) {
  timed("cross_entropy_backward", [&] {
    inner_.cross_entropy_backward(logits, targets, lse, vocab_offset, ignore_index, grad_scale, d_logits);
  });
}
void TimedBackend::softmax_chunk_update(const Tensor& logits, const Tensor& targets, int64_t vocab_offset,
                                        int32_t ignore_index, Tensor& row_max, Tensor& row_sum,
                                        Tensor& target_logit) {
  timed("softmax_chunk_update", [&] {
    inner_.softmax_chunk_update(logits, targets, vocab_offset, ignore_index, row_max, row_sum, target_logit);
  });
}

void TimedBackend::copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) {
  timed("copy_strided", [&] { inner_.copy_strided(src, dst, c); });
}
void TimedBackend::copy_from_host(std::span<const std::byte> src, Tensor& dst) {
  timed("copy_from_host", [&] { inner_.copy_from_host(src, dst); });
}
void TimedBackend::copy_to_host(const Tensor& src, std::span<std::byte> dst) {
  timed("copy_to_host", [&] { inner_.copy_to_host(src, dst); });
}
void TimedBackend::attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) {
  timed("attention_merge", [&] { inner_.attention_merge(block_out, block_lse, out, lse); });
}
void TimedBackend::softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) {
  timed("softmax_rescale", [&] { inner_.softmax_rescale(local_max, global_max, row_sum); });
}
LossSums TimedBackend::cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                            const Tensor& targets, int32_t ignore_index, Tensor& lse) {
  return timed("cross_entropy_finish", [&] {
    return inner_.cross_entropy_finish(row_max, row_sum, target_logit, targets, ignore_index, lse);
  });
}
int64_t TimedBackend::count_valid_targets(const Tensor& targets, int32_t ignore_index) {
  return timed("count_valid_targets", [&] { return inner_.count_valid_targets(targets, ignore_index); });
}

void TimedBackend::moe_route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights,
                                     Tensor& experts) {
  timed("moe_route_forward", [&] { inner_.moe_route_forward(logits, normalize, probs, weights, experts); });
}
void TimedBackend::moe_route_backward(const MoeRouteGrad& g, Tensor& d_logits) {
  timed("moe_route_backward", [&] { inner_.moe_route_backward(g, d_logits); });
}
void TimedBackend::gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) {
  timed("gather_rows", [&] { inner_.gather_rows(src, rows, scale, dst); });
}
void TimedBackend::scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) {
  timed("scatter_add_rows", [&] { inner_.scatter_add_rows(src, rows, scale, dst); });
}
void TimedBackend::rows_dot(const Tensor& a, const Tensor& b, Tensor& out) {
  timed("rows_dot", [&] { inner_.rows_dot(a, b, out); });
}
void TimedBackend::sigmoid_forward(const Tensor& x, Tensor& y) {
  timed("sigmoid_forward", [&] { inner_.sigmoid_forward(x, y); });
}
void TimedBackend::sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  timed("sigmoid_backward", [&] { inner_.sigmoid_backward(y, dy, dx); });
}

}  // namespace foldpar
