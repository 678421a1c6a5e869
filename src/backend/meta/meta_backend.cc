// MetaBackend: each op's checks (those of the real backends), then one record; no data.
#include "backend/meta/meta_backend.h"

#include <algorithm>
#include <vector>

#include "backend/op_checks.h"

namespace foldpar {
namespace {

// The real backends compute in f32 (the reference also f64) and store bf16 through the
// bf16 storage decorator; the meta backend stands for either, so it takes the three.
void check_floating(const Tensor& t, const char* what) {
  FP_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kF64 || t.dtype() == DType::kBF16,
           "meta backend {}: {} is not a floating type", what, t.describe());
}

int64_t bytes_of(std::initializer_list<const Tensor*> ts) {
  int64_t n = 0;
  for (const Tensor* t : ts) n += static_cast<int64_t>(t->nbytes());
  return n;
}

// Visible (query, key) pairs of one sequence: key j is visible to query i iff
// k_pos[j] <= q_pos[i].
int64_t visible_pairs(const Tensor& q_pos, const Tensor& k_pos) {
  std::vector<int32_t> k(k_pos.data<int32_t>(), k_pos.data<int32_t>() + k_pos.numel());
  std::sort(k.begin(), k.end());
  const int32_t* q = q_pos.data<int32_t>();
  int64_t pairs = 0;
  for (int64_t i = 0; i < q_pos.numel(); ++i) pairs += std::upper_bound(k.begin(), k.end(), q[i]) - k.begin();
  return pairs;
}

}  // namespace

MetaBackend::MetaBackend(MetaBackendOptions options) : options_(options) {}

std::unique_ptr<MetaBackend> make_meta_backend(MetaBackendOptions options) {
  return std::make_unique<MetaBackend>(options);
}

double MetaBackend::total_flops() const {
  double f = 0;
  for (const OpRecord& r : records_) f += r.flops;
  return f;
}

OpRecord& MetaBackend::record(std::string_view op, DType dtype, OpShape shape, double flops,
                              std::initializer_list<const Tensor*> read, std::initializer_list<const Tensor*> written) {
  OpRecord r;
  r.seq = (options_.order != nullptr ? *options_.order : own_order_).next();
  r.op = op;
  r.dtype = dtype;
  r.shape = shape;
  r.flops = flops;
  r.bytes_read = bytes_of(read);
  r.bytes_written = bytes_of(written);
  records_.push_back(r);
  return records_.back();
}

OpRecord& MetaBackend::record_tokenwise(std::string_view op, const Tensor& x, double flops,
                                        std::initializer_list<const Tensor*> read,
                                        std::initializer_list<const Tensor*> written) {
  OpShape s;
  s.rows = rows_of(x);
  s.width = x.dim(-1);
  return record(op, x.dtype(), s, flops, read, written);
}

void MetaBackend::matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float /*alpha*/, float beta) {
  const bool mixed = a.dtype() == DType::kBF16;
  const MatmulDims d = mixed ? check_matmul_bf16(a, ta, b, tb, c) : check_matmul(a, ta, b, tb, c);
  if (!mixed) check_floating(a, "matmul");
  FP_CHECK(!mixed || matmul_takes_bf16(), "meta backend matmul: bf16 operands but matmul_takes_bf16 is off");
  OpShape s;
  s.kind = OpShape::Kind::kMatmul;
  s.m = d.m;
  s.n = d.n;
  s.k = d.k;
  const double flops = 2.0 * static_cast<double>(d.m) * static_cast<double>(d.n) * static_cast<double>(d.k);
  if (beta != 0) {
    record("matmul", a.dtype(), s, flops, {&a, &b, &c}, {&c});
  } else {
    record("matmul", a.dtype(), s, flops, {&a, &b}, {&c});
  }
}

void MetaBackend::copy(const Tensor& src, Tensor& dst) {
  check_copy(src, dst);
  record_tokenwise("copy", src, 0, {&src}, {&dst});
}

void MetaBackend::add_inplace(const Tensor& x, Tensor& y) {
  check_add_inplace(x, y);
  check_floating(x, "add_inplace");
  record_tokenwise("add_inplace", y, 0, {&x, &y}, {&y});
}

void MetaBackend::scale_inplace(double /*alpha*/, Tensor& y) {
  check_floating(y, "scale_inplace");
  record_tokenwise("scale_inplace", y, 0, {&y}, {&y});
}

void MetaBackend::fill(double /*value*/, Tensor& y) {
  check_floating(y, "fill");
  record_tokenwise("fill", y, 0, {}, {&y});
}

double MetaBackend::sum_squares(const Tensor& x) {
  check_floating(x, "sum_squares");
  record_tokenwise("sum_squares", x, 0, {&x}, {});
  return 0;
}

void MetaBackend::adamw_update(const AdamWStep& /*s*/, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) {
  check_floating(param, "adamw_update");
  check_adamw(grad, param, m, v);
  record_tokenwise("adamw_update", param, 0, {&grad, &param, &m, &v}, {&param, &m, &v});
}

void MetaBackend::embedding_forward(const Tensor& ids, const Tensor& table, int64_t /*vocab_offset*/, Tensor& out) {
  check_embedding_forward(ids, table, out);
  check_floating(table, "embedding");
  // The rows that fall in the shard depend on the ids: count the whole output as written.
  record_tokenwise("embedding_forward", out, 0, {&ids}, {&out});
}

void MetaBackend::embedding_backward(const Tensor& ids, const Tensor& d_out, int64_t /*vocab_offset*/,
                                     Tensor& d_table) {
  check_embedding_backward(ids, d_out, d_table);
  check_floating(d_out, "embedding_backward");
  record_tokenwise("embedding_backward", d_out, 0, {&ids, &d_out}, {&d_table});
}

void MetaBackend::rmsnorm_forward(const Tensor& x, const Tensor& w, double /*eps*/, Tensor& y, Tensor& rstd) {
  check_rmsnorm_forward(x, w, y, rstd);
  check_floating(x, "rmsnorm");
  record_tokenwise("rmsnorm_forward", x, 0, {&x, &w}, {&y, &rstd});
}

void MetaBackend::rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                                   Tensor& dw) {
  check_rmsnorm_backward(x, w, rstd, dy, dx, dw);
  check_floating(x, "rmsnorm_backward");
  record_tokenwise("rmsnorm_backward", x, 0, {&x, &w, &rstd, &dy, &dw}, {&dx, &dw});
}

namespace {
// The CPU backend's rule: f32 tables (also for bf16 x, which the bf16 decorator widens).
void check_meta_rope(const Tensor& table, const Tensor& x) {
  check_floating(x, "rope");
  check_rope(table, x);
  FP_CHECK(table.dtype() == DType::kF32, "meta backend rope: table {} is not f32", table.describe());
}
}  // namespace

void MetaBackend::rope_forward(const Tensor& table, Tensor& x) {
  check_meta_rope(table, x);
  record_tokenwise("rope_forward", x, 0, {&table, &x}, {&x});
}

void MetaBackend::rope_backward(const Tensor& table, Tensor& dx) {
  check_meta_rope(table, dx);
  record_tokenwise("rope_backward", dx, 0, {&table, &dx}, {&dx});
}

void MetaBackend::attention(std::string_view op, const AttentionArgs& a, const Tensor& out, const Tensor& lse,
                            double flops_per_pair_and_head, std::initializer_list<const Tensor*> read,
                            std::initializer_list<const Tensor*> written) {
  const AttentionDims d = check_attention(a, out, lse);
  check_floating(out, op == "attention_forward" ? "attention" : "attention_backward");
  OpShape s;
  s.kind = OpShape::Kind::kAttention;
  s.batch = d.batch;
  s.sq = d.sq;
  s.sk = d.sk;
  s.n_h = d.n_h;
  s.n_kv = d.n_kv;
  s.d = d.d;
  if (options_.cpu_attention_scratch && d.batch > 0 && d.sq > 0 && d.n_h > 0 && d.sk > 0) {
    // Live for the call, as the kernel's: allocated and released in its order.
    const AttentionScratch sc = cpu_flash_attention_scratch(d, op == "attention_backward");
    Tensor work = Tensor::empty({sc.floats}, DType::kF32, MemCategory::kWorkspace);
    Tensor ranges = Tensor::empty({sc.range_ints}, DType::kI32, MemCategory::kWorkspace);
  }
  const bool exact = a.q_pos->has_storage() && a.k_pos->has_storage();
  const int64_t pairs = exact ? visible_pairs(*a.q_pos, *a.k_pos) : d.sq * d.sk;
  const double flops = flops_per_pair_and_head * static_cast<double>(d.d) * static_cast<double>(d.n_h) *
                       static_cast<double>(pairs) * static_cast<double>(d.batch);
  record(op, out.dtype(), s, flops, read, written).pairs_exact = exact;
}

void MetaBackend::attention_forward(const AttentionArgs& a, Tensor& out, Tensor& lse) {
  attention("attention_forward", a, out, lse, 4.0, {a.q, a.k, a.v, a.q_pos, a.k_pos}, {&out, &lse});
}

void MetaBackend::attention_backward(const AttentionArgs& a, const Tensor& out, const Tensor& lse,
                                     const Tensor& d_out, Tensor& dq, Tensor& dk, Tensor& dv) {
  check_attention_backward(a, out, lse, d_out, dq, dk, dv);
  attention("attention_backward", a, out, lse, 8.0, {a.q, a.k, a.v, a.q_pos, a.k_pos, &out, &lse, &d_out},
            {&dq, &dk, &dv});
}

void MetaBackend::swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  check_swiglu_forward(gate, up, out);
  check_floating(gate, "swiglu");
  record_tokenwise("swiglu_forward", gate, 0, {&gate, &up}, {&out});
}

void MetaBackend::swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, Tensor& d_gate,
                                  Tensor& d_up) {
  check_swiglu_backward(gate, up, d_out, d_gate, d_up);
  check_floating(gate, "swiglu_backward");
  record_tokenwise("swiglu_backward", gate, 0, {&gate, &up, &d_out}, {&d_gate, &d_up});
}

double MetaBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets, int32_t /*ignore_index*/,
                                          Tensor& lse) {
  check_floating(logits, "cross_entropy");
  check_cross_entropy_forward(logits, targets, lse);
  FP_CHECK(lse.dtype() == DType::kF32, "cross_entropy lse {}", lse.describe());
  record_tokenwise("cross_entropy_forward", logits, 0, {&logits, &targets}, {&lse});
  return 0;
}

void MetaBackend::cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                         int64_t /*vocab_offset*/, int32_t /*ignore_index*/, double /*grad_scale*/,
                                         Tensor& d_logits) {
  check_cross_entropy_backward(logits, targets, d_logits);
  check_floating(logits, "cross_entropy_backward");
  record_tokenwise("cross_entropy_backward", logits, 0, {&logits, &targets, &lse}, {&d_logits});
}

void MetaBackend::softmax_chunk_update(const Tensor& logits, const Tensor& targets, int64_t /*vocab_offset*/,
                                       int32_t /*ignore_index*/, Tensor& row_max, Tensor& row_sum,
                                       Tensor& target_logit) {
  check_floating(logits, "softmax_chunk_update");
  check_softmax_chunk_update(logits, targets, row_max, row_sum, target_logit);
  record_tokenwise("softmax_chunk_update", logits, 0, {&logits, &targets, &row_max, &row_sum},
                   {&row_max, &row_sum, &target_logit});
}

}  // namespace foldpar
