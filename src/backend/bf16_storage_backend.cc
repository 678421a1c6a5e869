// bf16 storage over an f32 backend: widen, compute, round.
#include "backend/bf16_storage_backend.h"

#include <algorithm>
#include <initializer_list>

namespace foldpar {
namespace {

bool is_bf16(const Tensor& t) { return t.defined() && t.dtype() == DType::kBF16; }

// f32 view of an input: the tensor itself, or a workspace copy widened by the inner
// backend's copy (so a dry run, whose tensors have no storage, counts it like any op).
Tensor widen(Backend& in, const Tensor& t) {
  if (!is_bf16(t)) return t;
  Tensor w = Tensor::empty(t.shape(), DType::kF32, MemCategory::kWorkspace);
  in.copy(t, w);
  return w;
}

// An output slot: computes into f32 and, for a bf16 destination, rounds back on finish()
// (the inner backend's copy, rounding to nearest even).
class Out {
 public:
  // accumulate: the op reads the old contents (+=, beta != 0, in place).
  Out(Backend& in, Tensor& dst, bool accumulate) : in_(in), dst_(dst) {
    if (!is_bf16(dst)) {
      f32_ = dst;
    } else {
      f32_ = accumulate ? widen(in, dst) : Tensor::empty(dst.shape(), DType::kF32, MemCategory::kWorkspace);
    }
  }
  Tensor& f32() { return f32_; }
  void finish() {
    if (is_bf16(dst_)) in_.copy(f32_, dst_);
  }

 private:
  Backend& in_;
  Tensor& dst_;
  Tensor f32_;
};

class Bf16StorageBackend final : public Backend {
 public:
  explicit Bf16StorageBackend(Backend& inner) : in_(inner) {}
  std::string_view name() const override { return in_.name(); }
  bool matmul_takes_bf16() const override { return in_.matmul_takes_bf16(); }
  bool tokenwise_takes_bf16() const override { return in_.tokenwise_takes_bf16(); }

  // bf16 x bf16 straight to an inner backend that multiplies bf16 natively (f32 accumulation,
  // c rounded once as below); elsewhere widened like every other op.
  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    if (is_bf16(a) && is_bf16(b) && in_.matmul_takes_bf16()) return in_.matmul(a, ta, b, tb, c, alpha, beta);
    Out o(in_, c, beta != 0.0f);
    in_.matmul(widen(in_, a), ta, widen(in_, b), tb, o.f32(), alpha, beta);
    o.finish();
  }
  // Backend::copy converts f32 <-> bf16 itself: no workspace.
  void copy(const Tensor& src, Tensor& dst) override { in_.copy(src, dst); }
  // Bytes move unchanged: no widening.
  void copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) override { in_.copy_strided(src, dst, c); }
  void copy_from_host(std::span<const std::byte> src, Tensor& dst) override { in_.copy_from_host(src, dst); }
  void copy_to_host(const Tensor& src, std::span<std::byte> dst) override { in_.copy_to_host(src, dst); }
  // The token-wise ops straight to an inner backend that reads and writes bf16 itself
  // (Backend::tokenwise_takes_bf16: the same bits as below); elsewhere widened.
  void add_inplace(const Tensor& x, Tensor& y) override {
    if (in_.tokenwise_takes_bf16()) return in_.add_inplace(x, y);
    Out o(in_, y, true);
    in_.add_inplace(widen(in_, x), o.f32());
    o.finish();
  }
  void scale_inplace(double alpha, Tensor& y) override {
    Out o(in_, y, true);
    in_.scale_inplace(alpha, o.f32());
    o.finish();
  }
  void fill(double value, Tensor& y) override {
    Out o(in_, y, false);
    in_.fill(value, o.f32());
    o.finish();
  }
  double sum_squares(const Tensor& x) override { return in_.sum_squares(widen(in_, x)); }
  void adamw_update(const AdamWStep& s, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) override {
    Out p(in_, param, true), mm(in_, m, true), vv(in_, v, true);
    in_.adamw_update(s, widen(in_, grad), p.f32(), mm.f32(), vv.f32());
    p.finish();
    mm.finish();
    vv.finish();
  }
  // All f32: straight to the inner backend's many-tensor op. With a bf16 tensor among
  // them, one tensor at a time (the defaults), so that only one tensor's widened copies
  // are alive at once, as with the single-tensor ops.
  void fill_many(double value, std::span<Tensor* const> ys) override {
    if (std::none_of(ys.begin(), ys.end(), [](const Tensor* t) { return is_bf16(*t); })) return in_.fill_many(value, ys);
    Backend::fill_many(value, ys);
  }
  void sum_squares_many(std::span<const Tensor* const> xs, std::span<double> out) override {
    if (std::none_of(xs.begin(), xs.end(), [](const Tensor* t) { return is_bf16(*t); })) return in_.sum_squares_many(xs, out);
    Backend::sum_squares_many(xs, out);
  }
  void adamw_update_many(const AdamWStep& s, std::span<const AdamWTensors> ts) override {
    const bool any_bf16 = std::any_of(ts.begin(), ts.end(), [](const AdamWTensors& t) {
      return is_bf16(*t.grad) || is_bf16(*t.param) || is_bf16(*t.m) || is_bf16(*t.v) ||
             (t.rounded != nullptr && is_bf16(*t.rounded));
    });
    if (!any_bf16) return in_.adamw_update_many(s, ts);
    Backend::adamw_update_many(s, ts);
  }
  void embedding_forward(const Tensor& ids, const Tensor& table, int64_t off, Tensor& out) override {
    Out o(in_, out, true);  // rows outside the shard keep their contents
    in_.embedding_forward(ids, widen(in_, table), off, o.f32());
    o.finish();
  }
  void embedding_backward(const Tensor& ids, const Tensor& d_out, int64_t off, Tensor& d_table) override {
    Out o(in_, d_table, true);
    in_.embedding_backward(ids, widen(in_, d_out), off, o.f32());
    o.finish();
  }
  void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) override {
    if (in_.tokenwise_takes_bf16() && !is_bf16(rstd)) return in_.rmsnorm_forward(x, w, eps, y, rstd);
    Out oy(in_, y, false), orr(in_, rstd, false);
    in_.rmsnorm_forward(widen(in_, x), widen(in_, w), eps, oy.f32(), orr.f32());
    oy.finish();
    orr.finish();
  }
  void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dw) override {
    if (in_.tokenwise_takes_bf16() && !is_bf16(rstd)) return in_.rmsnorm_backward(x, w, rstd, dy, dx, dw);
    Out odx(in_, dx, false), odw(in_, dw, true);
    in_.rmsnorm_backward(widen(in_, x), widen(in_, w), widen(in_, rstd), widen(in_, dy), odx.f32(), odw.f32());
    odx.finish();
    odw.finish();
  }
  void rope_forward(const Tensor& table, Tensor& x) override {
    if (in_.tokenwise_takes_bf16() && !is_bf16(table)) return in_.rope_forward(table, x);
    Out o(in_, x, true);
    in_.rope_forward(widen(in_, table), o.f32());
    o.finish();
  }
  void rope_backward(const Tensor& table, Tensor& dx) override {
    if (in_.tokenwise_takes_bf16() && !is_bf16(table)) return in_.rope_backward(table, dx);
    Out o(in_, dx, true);
    in_.rope_backward(widen(in_, table), o.f32());
    o.finish();
  }
  // bf16 q, k, v straight to an inner backend that multiplies bf16 natively (its attention
  // then runs the products in bf16 with f32 accumulation and softmax, rounding out, dq, dk,
  // dv once, as below); elsewhere widened and run by the f32 kernel.
  void attention_forward(const AttentionArgs& a, Tensor& out, Tensor& lse) override {
    if (bf16_attention(a, {&out})) return in_.attention_forward(a, out, lse);
    const Tensor q = widen(in_, *a.q), k = widen(in_, *a.k), v = widen(in_, *a.v);
    const AttentionArgs w{&q, &k, &v, a.q_pos, a.k_pos, a.scale, a.window};
    Out oo(in_, out, false), ol(in_, lse, false);
    in_.attention_forward(w, oo.f32(), ol.f32());
    oo.finish();
    ol.finish();
  }
  void attention_backward(const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& d_out,
                          Tensor& dq, Tensor& dk, Tensor& dv) override {
    if (bf16_attention(a, {&out, &d_out, &dq, &dk, &dv})) return in_.attention_backward(a, out, lse, d_out, dq, dk, dv);
    const Tensor q = widen(in_, *a.q), k = widen(in_, *a.k), v = widen(in_, *a.v);
    const AttentionArgs w{&q, &k, &v, a.q_pos, a.k_pos, a.scale, a.window};
    Out oq(in_, dq, false), ok(in_, dk, false), ov(in_, dv, false);
    in_.attention_backward(w, widen(in_, out), widen(in_, lse), widen(in_, d_out), oq.f32(), ok.f32(), ov.f32());
    oq.finish();
    ok.finish();
    ov.finish();
  }
  void attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) override {
    Out oo(in_, out, true), ol(in_, lse, true);
    in_.attention_merge(widen(in_, block_out), widen(in_, block_lse), oo.f32(), ol.f32());
    oo.finish();
    ol.finish();
  }
  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) override {
    if (in_.tokenwise_takes_bf16()) return in_.swiglu_forward(gate, up, out);
    Out o(in_, out, false);
    in_.swiglu_forward(widen(in_, gate), widen(in_, up), o.f32());
    o.finish();
  }
  void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, Tensor& d_gate,
                       Tensor& d_up) override {
    if (in_.tokenwise_takes_bf16()) return in_.swiglu_backward(gate, up, d_out, d_gate, d_up);
    Out og(in_, d_gate, false), ou(in_, d_up, false);
    in_.swiglu_backward(widen(in_, gate), widen(in_, up), widen(in_, d_out), og.f32(), ou.f32());
    og.finish();
    ou.finish();
  }
  double cross_entropy_forward(const Tensor& logits, const Tensor& targets, int32_t ignore, Tensor& lse) override {
    Out o(in_, lse, false);
    const double loss = in_.cross_entropy_forward(widen(in_, logits), targets, ignore, o.f32());
    o.finish();
    return loss;
  }
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t off,
                              int32_t ignore, double scale, Tensor& d_logits) override {
    // d_logits may alias logits: widen the input before the output slot is made.
    const Tensor x = widen(in_, logits);
    Out o(in_, d_logits, false);
    in_.cross_entropy_backward(x, targets, widen(in_, lse), off, ignore, scale, o.f32());
    o.finish();
  }
  void softmax_chunk_update(const Tensor& logits, const Tensor& targets, int64_t off, int32_t ignore, Tensor& row_max,
                            Tensor& row_sum, Tensor& target_logit) override {
    Out om(in_, row_max, true), os(in_, row_sum, true), ot(in_, target_logit, true);
    in_.softmax_chunk_update(widen(in_, logits), targets, off, ignore, om.f32(), os.f32(), ot.f32());
    om.finish();
    os.finish();
    ot.finish();
  }
  void softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) override {
    Out o(in_, row_sum, true);
    in_.softmax_rescale(widen(in_, local_max), widen(in_, global_max), o.f32());
    o.finish();
  }
  LossSums cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                const Tensor& targets, int32_t ignore, Tensor& lse) override {
    Out o(in_, lse, false);
    const LossSums sums =
        in_.cross_entropy_finish(widen(in_, row_max), widen(in_, row_sum), widen(in_, target_logit), targets, ignore, o.f32());
    o.finish();
    return sums;
  }
  // The MoE ops widen their float operands; ids move unchanged. The router runs in f32.
  void moe_route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights,
                         Tensor& experts) override {
    Out p(in_, probs, false), w(in_, weights, false);
    in_.moe_route_forward(widen(in_, logits), normalize, p.f32(), w.f32(), experts);
    p.finish();
    w.finish();
  }
  void moe_route_backward(const MoeRouteGrad& g, Tensor& d_logits) override {
    const Tensor probs = widen(in_, *g.probs), weights = widen(in_, *g.weights), d_weights = widen(in_, *g.d_weights);
    Tensor bias;
    if (g.d_probs_bias != nullptr) bias = widen(in_, *g.d_probs_bias);
    MoeRouteGrad wide = g;
    wide.probs = &probs;
    wide.weights = &weights;
    wide.d_weights = &d_weights;
    wide.d_probs_bias = g.d_probs_bias == nullptr ? nullptr : &bias;
    Out o(in_, d_logits, false);
    in_.moe_route_backward(wide, o.f32());
    o.finish();
  }
  void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override {
    Tensor s;
    if (scale != nullptr) s = widen(in_, *scale);
    Out o(in_, dst, false);
    in_.gather_rows(widen(in_, src), rows, scale == nullptr ? nullptr : &s, o.f32());
    o.finish();
  }
  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override {
    Tensor s;
    if (scale != nullptr) s = widen(in_, *scale);
    Out o(in_, dst, true);
    in_.scatter_add_rows(widen(in_, src), rows, scale == nullptr ? nullptr : &s, o.f32());
    o.finish();
  }
  void rows_dot(const Tensor& a, const Tensor& b, Tensor& out) override {
    Out o(in_, out, false);
    in_.rows_dot(widen(in_, a), widen(in_, b), o.f32());
    o.finish();
  }
  void sigmoid_forward(const Tensor& x, Tensor& y) override {
    Out o(in_, y, false);
    in_.sigmoid_forward(widen(in_, x), o.f32());
    o.finish();
  }
  void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    Out o(in_, dx, false);
    in_.sigmoid_backward(widen(in_, y), widen(in_, dy), o.f32());
    o.finish();
  }
  int64_t count_valid_targets(const Tensor& targets, int32_t ignore) override {
    return in_.count_valid_targets(targets, ignore);
  }

 private:
  bool bf16_attention(const AttentionArgs& a, std::initializer_list<const Tensor*> others) const {
    if (!in_.matmul_takes_bf16() || !is_bf16(*a.q) || !is_bf16(*a.k) || !is_bf16(*a.v)) return false;
    for (const Tensor* t : others)
      if (!is_bf16(*t)) return false;
    return true;
  }

  Backend& in_;
};

}  // namespace

std::unique_ptr<Backend> make_bf16_storage_backend(Backend& inner) {
  return std::make_unique<Bf16StorageBackend>(inner);
}

}  // namespace foldpar
