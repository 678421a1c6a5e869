// bf16 storage over an f32 backend: widen, compute, round.
#include "backend/bf16_storage_backend.h"

#include <vector>

namespace foldpar {
namespace {

bool is_bf16(const Tensor& t) { return t.defined() && t.dtype() == DType::kBF16; }

// f32 view of an input: the tensor itself, or a widened workspace copy.
Tensor widen(const Tensor& t) { return is_bf16(t) ? t.to(DType::kF32, MemCategory::kWorkspace) : t; }

// An output slot: computes into f32 and, for a bf16 destination, rounds back on finish().
class Out {
 public:
  // accumulate: the op reads the old contents (+=, beta != 0, in place).
  Out(Tensor& dst, bool accumulate) : dst_(dst) {
    if (!is_bf16(dst)) {
      f32_ = dst;
    } else {
      f32_ = accumulate ? dst.to(DType::kF32, MemCategory::kWorkspace)
                        : Tensor::empty(dst.shape(), DType::kF32, MemCategory::kWorkspace);
    }
  }
  Tensor& f32() { return f32_; }
  void finish() {
    if (!is_bf16(dst_)) return;
    const float* s = f32_.data<float>();
    bf16* d = dst_.data<bf16>();
    for (int64_t i = 0; i < dst_.numel(); ++i) d[i] = f32_to_bf16(s[i]);
  }

 private:
  Tensor& dst_;
  Tensor f32_;
};

class Bf16StorageBackend final : public Backend {
 public:
  explicit Bf16StorageBackend(Backend& inner) : in_(inner) {}
  std::string_view name() const override { return in_.name(); }
  bool matmul_takes_bf16() const override { return in_.matmul_takes_bf16(); }

  // bf16 x bf16 straight to an inner backend that multiplies bf16 natively (f32 accumulation,
  // c rounded once as below); elsewhere widened like every other op.
  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    if (is_bf16(a) && is_bf16(b) && in_.matmul_takes_bf16()) return in_.matmul(a, ta, b, tb, c, alpha, beta);
    Out o(c, beta != 0.0f);
    in_.matmul(widen(a), ta, widen(b), tb, o.f32(), alpha, beta);
    o.finish();
  }
  void copy(const Tensor& src, Tensor& dst) override {
    if (src.dtype() == dst.dtype()) return in_.copy(src, dst);
    Out o(dst, false);
    in_.copy(widen(src), o.f32());
    o.finish();
  }
  // Bytes move unchanged: no widening.
  void copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) override { in_.copy_strided(src, dst, c); }
  void copy_from_host(std::span<const std::byte> src, Tensor& dst) override { in_.copy_from_host(src, dst); }
  void copy_to_host(const Tensor& src, std::span<std::byte> dst) override { in_.copy_to_host(src, dst); }
  void add_inplace(const Tensor& x, Tensor& y) override {
    Out o(y, true);
    in_.add_inplace(widen(x), o.f32());
    o.finish();
  }
  void scale_inplace(double alpha, Tensor& y) override {
    Out o(y, true);
    in_.scale_inplace(alpha, o.f32());
    o.finish();
  }
  void fill(double value, Tensor& y) override {
    Out o(y, false);
    in_.fill(value, o.f32());
    o.finish();
  }
  double sum_squares(const Tensor& x) override { return in_.sum_squares(widen(x)); }
  void adamw_update(const AdamWStep& s, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) override {
    Out p(param, true), mm(m, true), vv(v, true);
    in_.adamw_update(s, widen(grad), p.f32(), mm.f32(), vv.f32());
    p.finish();
    mm.finish();
    vv.finish();
  }
  void embedding_forward(const Tensor& ids, const Tensor& table, int64_t off, Tensor& out) override {
    Out o(out, true);  // rows outside the shard keep their contents
    in_.embedding_forward(ids, widen(table), off, o.f32());
    o.finish();
  }
  void embedding_backward(const Tensor& ids, const Tensor& d_out, int64_t off, Tensor& d_table) override {
    Out o(d_table, true);
    in_.embedding_backward(ids, widen(d_out), off, o.f32());
    o.finish();
  }
  void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) override {
    Out oy(y, false), orr(rstd, false);
    in_.rmsnorm_forward(widen(x), widen(w), eps, oy.f32(), orr.f32());
    oy.finish();
    orr.finish();
  }
  void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dw) override {
    Out odx(dx, false), odw(dw, true);
    in_.rmsnorm_backward(widen(x), widen(w), widen(rstd), widen(dy), odx.f32(), odw.f32());
    odx.finish();
    odw.finish();
  }
  void rope_forward(const Tensor& table, Tensor& x) override {
    Out o(x, true);
    in_.rope_forward(widen(table), o.f32());
    o.finish();
  }
  void rope_backward(const Tensor& table, Tensor& dx) override {
    Out o(dx, true);
    in_.rope_backward(widen(table), o.f32());
    o.finish();
  }
  void attention_forward(const AttentionArgs& a, Tensor& out, Tensor& lse) override {
    const Tensor q = widen(*a.q), k = widen(*a.k), v = widen(*a.v);
    const AttentionArgs w{&q, &k, &v, a.q_pos, a.k_pos, a.scale};
    Out oo(out, false), ol(lse, false);
    in_.attention_forward(w, oo.f32(), ol.f32());
    oo.finish();
    ol.finish();
  }
  void attention_backward(const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& d_out,
                          Tensor& dq, Tensor& dk, Tensor& dv) override {
    const Tensor q = widen(*a.q), k = widen(*a.k), v = widen(*a.v);
    const AttentionArgs w{&q, &k, &v, a.q_pos, a.k_pos, a.scale};
    Out oq(dq, false), ok(dk, false), ov(dv, false);
    in_.attention_backward(w, widen(out), widen(lse), widen(d_out), oq.f32(), ok.f32(), ov.f32());
    oq.finish();
    ok.finish();
    ov.finish();
  }
  void attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) override {
    Out oo(out, true), ol(lse, true);
    in_.attention_merge(widen(block_out), widen(block_lse), oo.f32(), ol.f32());
    oo.finish();
    ol.finish();
  }
  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) override {
    Out o(out, false);
    in_.swiglu_forward(widen(gate), widen(up), o.f32());
    o.finish();
  }
  void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, Tensor& d_gate,
                       Tensor& d_up) override {
    Out og(d_gate, false), ou(d_up, false);
    in_.swiglu_backward(widen(gate), widen(up), widen(d_out), og.f32(), ou.f32());
    og.finish();
    ou.finish();
  }
  double cross_entropy_forward(const Tensor& logits, const Tensor& targets, int32_t ignore, Tensor& lse) override {
    Out o(lse, false);
    const double loss = in_.cross_entropy_forward(widen(logits), targets, ignore, o.f32());
    o.finish();
    return loss;
  }
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t off,
                              int32_t ignore, double scale, Tensor& d_logits) override {
    // d_logits may alias logits: widen the input before the output slot is made.
    const Tensor x = widen(logits);
    Out o(d_logits, false);
    in_.cross_entropy_backward(x, targets, widen(lse), off, ignore, scale, o.f32());
    o.finish();
  }
  void softmax_chunk_update(const Tensor& logits, const Tensor& targets, int64_t off, int32_t ignore, Tensor& row_max,
                            Tensor& row_sum, Tensor& target_logit) override {
    Out om(row_max, true), os(row_sum, true), ot(target_logit, true);
    in_.softmax_chunk_update(widen(logits), targets, off, ignore, om.f32(), os.f32(), ot.f32());
    om.finish();
    os.finish();
    ot.finish();
  }
  void softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) override {
    Out o(row_sum, true);
    in_.softmax_rescale(widen(local_max), widen(global_max), o.f32());
    o.finish();
  }
  LossSums cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                const Tensor& targets, int32_t ignore, Tensor& lse) override {
    Out o(lse, false);
    const LossSums sums =
        in_.cross_entropy_finish(widen(row_max), widen(row_sum), widen(target_logit), targets, ignore, o.f32());
    o.finish();
    return sums;
  }
  // The MoE ops widen their float operands; ids move unchanged. The router runs in f32.
  void moe_route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights,
                         Tensor& experts) override {
    Out p(probs, false), w(weights, false);
    in_.moe_route_forward(widen(logits), normalize, p.f32(), w.f32(), experts);
    p.finish();
    w.finish();
  }
  void moe_route_backward(const MoeRouteGrad& g, Tensor& d_logits) override {
    const Tensor probs = widen(*g.probs), weights = widen(*g.weights), d_weights = widen(*g.d_weights);
    Tensor bias;
    if (g.d_probs_bias != nullptr) bias = widen(*g.d_probs_bias);
    MoeRouteGrad wide = g;
    wide.probs = &probs;
    wide.weights = &weights;
    wide.d_weights = &d_weights;
    wide.d_probs_bias = g.d_probs_bias == nullptr ? nullptr : &bias;
    Out o(d_logits, false);
    in_.moe_route_backward(wide, o.f32());
    o.finish();
  }
  void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override {
    Tensor s;
    if (scale != nullptr) s = widen(*scale);
    Out o(dst, false);
    in_.gather_rows(widen(src), rows, scale == nullptr ? nullptr : &s, o.f32());
    o.finish();
  }
  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override {
    Tensor s;
    if (scale != nullptr) s = widen(*scale);
    Out o(dst, true);
    in_.scatter_add_rows(widen(src), rows, scale == nullptr ? nullptr : &s, o.f32());
    o.finish();
  }
  void rows_dot(const Tensor& a, const Tensor& b, Tensor& out) override {
    Out o(out, false);
    in_.rows_dot(widen(a), widen(b), o.f32());
    o.finish();
  }
  void sigmoid_forward(const Tensor& x, Tensor& y) override {
    Out o(y, false);
    in_.sigmoid_forward(widen(x), o.f32());
    o.finish();
  }
  void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    Out o(dx, false);
    in_.sigmoid_backward(widen(y), widen(dy), o.f32());
    o.finish();
  }
  int64_t count_valid_targets(const Tensor& targets, int32_t ignore) override {
    return in_.count_valid_targets(targets, ignore);
  }

 private:
  Backend& in_;
};

}  // namespace

std::unique_ptr<Backend> make_bf16_storage_backend(Backend& inner) {
  return std::make_unique<Bf16StorageBackend>(inner);
}

}  // namespace foldpar
