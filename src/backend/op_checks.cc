// Shape and dtype checks of backend ops.
#include "backend/op_checks.h"

namespace foldpar {

int64_t rows_of(const Tensor& x) {
  FP_CHECK(x.rank() >= 1, "scalar where a matrix was expected");
  const int64_t w = x.dim(-1);
  return w == 0 ? 0 : x.numel() / w;
}

void check_same(const Tensor& a, const Tensor& b, const char* what) {
  FP_CHECK(a.numel() == b.numel() && a.dim(-1) == b.dim(-1) && a.dtype() == b.dtype(), "{}: {} vs {}", what,
           a.describe(), b.describe());
}

void check_float(const Tensor& t, const char* what) {
  FP_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kF64, "{}: {} is not f32/f64", what, t.describe());
}

void check_i32_vector(const Tensor& t, int64_t n, const char* what) {
  FP_CHECK(t.dtype() == DType::kI32 && t.numel() == n, "{}: {} where i32[{}] was expected", what, t.describe(),
           n);
}

namespace {
MatmulDims matmul_dims(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c) {
  const int64_t a_rows = rows_of(a), a_cols = a.dim(-1);
  const int64_t b_rows = rows_of(b), b_cols = b.dim(-1);
  MatmulDims d{};
  d.m = trans_a ? a_cols : a_rows;
  d.k = trans_a ? a_rows : a_cols;
  const int64_t kb = trans_b ? b_cols : b_rows;
  d.n = trans_b ? b_rows : b_cols;
  FP_CHECK(d.k == kb && rows_of(c) == d.m && c.dim(-1) == d.n, "matmul {}{} x {}{} -> {}", a.shape().to_string(),
           trans_a ? "^T" : "", b.shape().to_string(), trans_b ? "^T" : "", c.shape().to_string());
  d.lda = a_cols;
  d.ldb = b_cols;
  return d;
}
}  // namespace

MatmulDims check_matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c) {
  FP_CHECK(a.dtype() == b.dtype() && b.dtype() == c.dtype(), "matmul dtypes {} {} {}", a.describe(),
           b.describe(), c.describe());
  return matmul_dims(a, trans_a, b, trans_b, c);
}

MatmulDims check_matmul_bf16(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c) {
  FP_CHECK(a.dtype() == DType::kBF16 && b.dtype() == DType::kBF16 &&
               (c.dtype() == DType::kBF16 || c.dtype() == DType::kF32),
           "bf16 matmul dtypes {} {} {}", a.describe(), b.describe(), c.describe());
  return matmul_dims(a, trans_a, b, trans_b, c);
}

AttentionDims check_attention(const AttentionArgs& args, const Tensor& out, const Tensor& lse) {
  FP_CHECK(args.q && args.k && args.v && args.q_pos && args.k_pos, "attention: missing argument");
  const Tensor &q = *args.q, &k = *args.k, &v = *args.v;
  FP_CHECK(q.rank() == 4 && k.rank() == 4 && v.rank() == 4, "attention ranks {} {} {}", q.describe(),
           k.describe(), v.describe());
  AttentionDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), k.dim(2), q.dim(3), args.window};
  FP_CHECK(d.window >= 0, "attention window {} must be 0 (off) or positive", d.window);
  FP_CHECK(k.shape() == v.shape() && k.dim(0) == d.batch && k.dim(3) == d.d, "attention k {} v {} q {}",
           k.describe(), v.describe(), q.describe());
  FP_CHECK(d.n_kv > 0 && d.n_h > 0 && d.n_h % d.n_kv == 0, "attention heads {} not a multiple of kv heads {}", d.n_h, d.n_kv);
  // lse in q's dtype, or f32 beside bf16 q (stat_dtype): a backend that stores bf16 keeps
  // its log-sum-exp in f32, as the bf16 storage decorator's callers do.
  FP_CHECK(q.dtype() == k.dtype() && k.dtype() == v.dtype() && out.dtype() == q.dtype() &&
               (lse.dtype() == q.dtype() || (q.dtype() == DType::kBF16 && lse.dtype() == DType::kF32)),
           "attention dtypes");
  FP_CHECK(out.shape() == q.shape(), "attention out {} vs q {}", out.describe(), q.describe());
  FP_CHECK(lse.numel() == d.batch * d.n_h * d.sq, "attention lse {} for B={} n_h={} Sq={}", lse.describe(),
           d.batch, d.n_h, d.sq);
  check_i32_vector(*args.q_pos, d.sq, "attention q_pos");
  check_i32_vector(*args.k_pos, d.sk, "attention k_pos");
  return d;
}

void check_copy(const Tensor& src, const Tensor& dst) {
  const auto f32_bf16 = [](DType a, DType b) { return a == DType::kF32 && b == DType::kBF16; };
  const bool convert = f32_bf16(src.dtype(), dst.dtype()) || f32_bf16(dst.dtype(), src.dtype());
  FP_CHECK(src.numel() == dst.numel() && (src.dtype() == dst.dtype() || convert),
           "copy {} -> {} (same numel; same dtype, or f32 <-> bf16)", src.describe(), dst.describe());
}

void check_add_inplace(const Tensor& x, const Tensor& y, bool mixed_bf16) {
  auto f32_or_bf16 = [](const Tensor& t) { return t.dtype() == DType::kF32 || t.dtype() == DType::kBF16; };
  const bool dtypes_ok = x.dtype() == y.dtype() || (mixed_bf16 && f32_or_bf16(x) && f32_or_bf16(y));
  FP_CHECK(x.numel() == y.numel() && dtypes_ok, "add_inplace {} into {}", x.describe(), y.describe());
}

void check_adamw(const Tensor& grad, const Tensor& param, const Tensor& m, const Tensor& v) {
  FP_CHECK(grad.numel() == param.numel() && m.numel() == param.numel() && v.numel() == param.numel(),
           "adamw shapes {} {} {} {}", grad.describe(), param.describe(), m.describe(), v.describe());
}

void check_embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& out) {
  check_i32_vector(ids, rows_of(out), "embedding ids");
  FP_CHECK(table.rank() == 2 && out.dim(-1) == table.dim(1) && out.dtype() == table.dtype(), "embedding out {} table {}",
           out.describe(), table.describe());
}

void check_embedding_backward(const Tensor& ids, const Tensor& d_out, const Tensor& d_table) {
  check_i32_vector(ids, rows_of(d_out), "embedding ids");
  // d_table in d_out's dtype, or f32 gradients beside bf16 activations.
  const bool f32_grads = d_out.dtype() == DType::kBF16 && d_table.dtype() == DType::kF32;
  FP_CHECK(d_table.rank() == 2 && d_out.dim(-1) == d_table.dim(1) && (d_out.dtype() == d_table.dtype() || f32_grads),
           "embedding_backward {} into {}", d_out.describe(), d_table.describe());
}

void check_rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd) {
  check_same(x, y, "rmsnorm y");
  FP_CHECK(w.numel() == x.dim(-1) && rstd.numel() == rows_of(x), "rmsnorm w {} rstd {} x {}", w.describe(),
           rstd.describe(), x.describe());
}

void check_rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                            const Tensor& dw) {
  check_same(x, dy, "rmsnorm dy");
  check_same(x, dx, "rmsnorm dx");
  FP_CHECK(w.numel() == x.dim(-1) && rstd.numel() == rows_of(x) && dw.numel() == x.dim(-1),
           "rmsnorm w {} rstd {} dw {} x {}", w.describe(), rstd.describe(), dw.describe(), x.describe());
}

void check_rope(const Tensor& table, const Tensor& x) {
  FP_CHECK(x.rank() == 4 && table.rank() == 3 && table.dim(0) == x.dim(1) && table.dim(1) == 2 &&
               table.dim(2) * 2 == x.dim(3),
           "rope: x {} table {}", x.describe(), table.describe());
}

AttentionDims check_attention_backward(const AttentionArgs& args, const Tensor& out, const Tensor& lse,
                                       const Tensor& d_out, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const AttentionDims d = check_attention(args, out, lse);
  FP_CHECK(d_out.shape() == out.shape() && dq.shape() == args.q->shape() && dk.shape() == args.k->shape() &&
               dv.shape() == args.v->shape(),
           "attention backward shapes");
  return d;
}

void check_swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out) {
  check_same(gate, up, "swiglu up");
  check_same(gate, out, "swiglu out");
}

void check_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, const Tensor& d_gate,
                           const Tensor& d_up) {
  check_same(gate, up, "swiglu up");
  check_same(gate, d_out, "swiglu d_out");
  check_same(gate, d_gate, "swiglu d_gate");
  check_same(gate, d_up, "swiglu d_up");
}

int64_t check_cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& lse) {
  const int64_t rows = rows_of(logits);
  check_i32_vector(targets, rows, "cross_entropy targets");
  FP_CHECK(lse.numel() == rows, "cross_entropy lse {}", lse.describe());
  return rows;
}

int64_t check_cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& d_logits) {
  check_same(logits, d_logits, "cross_entropy d_logits");
  const int64_t rows = rows_of(logits);
  check_i32_vector(targets, rows, "cross_entropy targets");
  return rows;
}

int64_t check_softmax_chunk_update(const Tensor& logits, const Tensor& targets, const Tensor& row_max,
                                   const Tensor& row_sum, const Tensor& target_logit) {
  const int64_t rows = rows_of(logits);
  check_i32_vector(targets, rows, "softmax_chunk_update targets");
  FP_CHECK(row_max.numel() == rows && row_sum.numel() == rows && target_logit.numel() == rows,
           "softmax_chunk_update rows {}", rows);
  return rows;
}

namespace {
void check_block(const Tensor& t, const StridedBlock& b, int64_t rows, int64_t cols, const char* what) {
  FP_CHECK(b.offset >= 0 && b.row_stride >= 0, "copy_strided {}: offset {} and row stride {} of {}", what, b.offset,
           b.row_stride, t.describe());
  const int64_t last = b.offset + (rows - 1) * b.row_stride + cols;
  FP_CHECK(last <= t.numel(), "copy_strided {}: {} rows of {} at offset {}, row stride {}, reach element {} of {}",
           what, rows, cols, b.offset, b.row_stride, last, t.describe());
}
}  // namespace

bool check_copy_strided(const Tensor& src, const Tensor& dst, const StridedCopy& c) {
  FP_CHECK(src.dtype() == dst.dtype(), "copy_strided {} -> {}: dtypes differ", src.describe(), dst.describe());
  FP_CHECK(c.rows >= 0 && c.cols >= 0, "copy_strided of {} rows of {}", c.rows, c.cols);
  if (c.rows == 0 || c.cols == 0) return false;
  FP_CHECK(c.rows == 1 || c.dst.row_stride >= c.cols, "copy_strided: destination rows of {} overlap at stride {}",
           c.cols, c.dst.row_stride);
  check_block(src, c.src, c.rows, c.cols, "source");
  check_block(dst, c.dst, c.rows, c.cols, "destination");
  return true;
}

void check_host_copy(const Tensor& t, size_t host_bytes, const char* what) {
  FP_CHECK(t.nbytes() == host_bytes, "{}: {} host bytes for {} ({} bytes)", what, host_bytes, t.describe(),
           t.nbytes());
}

AttentionMergeDims check_attention_merge(const Tensor& block_out, const Tensor& block_lse, const Tensor& out,
                                         const Tensor& lse) {
  FP_CHECK(out.rank() == 4 && block_out.shape() == out.shape() && block_lse.shape() == lse.shape() &&
               lse.numel() == out.dim(0) * out.dim(2) * out.dim(1) && out.dtype() == block_out.dtype() &&
               lse.dtype() == block_lse.dtype(),
           "attention_merge of block {} / {} into {} / {}", block_out.describe(), block_lse.describe(),
           out.describe(), lse.describe());
  return {out.dim(0), out.dim(1), out.dim(2), out.dim(3)};
}

int64_t check_softmax_rescale(const Tensor& local_max, const Tensor& global_max, const Tensor& row_sum) {
  const int64_t n = row_sum.numel();
  FP_CHECK(local_max.numel() == n && global_max.numel() == n && local_max.dtype() == row_sum.dtype() &&
               global_max.dtype() == row_sum.dtype(),
           "softmax_rescale of {} by {} / {}", row_sum.describe(), local_max.describe(), global_max.describe());
  return n;
}

int64_t check_cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                   const Tensor& targets, const Tensor& lse) {
  const int64_t n = lse.numel();
  FP_CHECK(row_max.numel() == n && row_sum.numel() == n && target_logit.numel() == n &&
               row_max.dtype() == lse.dtype() && row_sum.dtype() == lse.dtype() &&
               target_logit.dtype() == lse.dtype(),
           "cross_entropy_finish of {} / {} / {} into {}", row_max.describe(), row_sum.describe(),
           target_logit.describe(), lse.describe());
  check_i32_vector(targets, n, "cross_entropy_finish targets");
  return n;
}

void check_targets(const Tensor& targets) {
  FP_CHECK(targets.dtype() == DType::kI32, "targets {} are not i32", targets.describe());
}

MoeRouteDims check_moe_route_forward(const Tensor& logits, const Tensor& probs, const Tensor& weights,
                                     const Tensor& experts) {
  FP_CHECK(logits.rank() == 2 && probs.shape() == logits.shape() && probs.dtype() == logits.dtype(),
           "moe_route logits {} probs {}", logits.describe(), probs.describe());
  const MoeRouteDims d{logits.dim(0), logits.dim(1), weights.rank() == 2 ? weights.dim(1) : -1};
  FP_CHECK(weights.rank() == 2 && weights.dim(0) == d.rows && weights.dtype() == logits.dtype() && d.k >= 1 &&
               d.k <= d.experts,
           "moe_route weights {} for logits {}", weights.describe(), logits.describe());
  FP_CHECK(experts.dtype() == DType::kI32 && experts.shape() == weights.shape(), "moe_route experts {} weights {}",
           experts.describe(), weights.describe());
  return d;
}

MoeRouteDims check_moe_route_backward(const Backend::MoeRouteGrad& g, const Tensor& d_logits) {
  FP_CHECK(g.probs && g.weights && g.experts && g.d_weights, "moe_route_backward: missing argument");
  const MoeRouteDims d = check_moe_route_forward(*g.probs, d_logits, *g.weights, *g.experts);
  check_same(*g.weights, *g.d_weights, "moe_route_backward d_weights");
  if (g.d_probs_bias != nullptr)
    FP_CHECK(g.d_probs_bias->numel() == d.experts && g.d_probs_bias->dtype() == d_logits.dtype(),
             "moe_route_backward d_probs_bias {} for E={}", g.d_probs_bias->describe(), d.experts);
  return d;
}

namespace {
RowsDims check_rows(const Tensor& many, const Tensor& listed, const Tensor& rows, const Tensor* scale,
                    const char* op) {
  FP_CHECK(many.rank() >= 1 && listed.rank() >= 1 && many.dtype() == listed.dtype() &&
               many.dim(-1) == listed.dim(-1),
           "{}: {} and {}", op, many.describe(), listed.describe());
  const RowsDims d{rows_of(many), rows_of(listed), many.dim(-1)};
  check_i32_vector(rows, d.m, op);
  if (scale != nullptr)
    FP_CHECK(scale->numel() == d.m && scale->dtype() == many.dtype(), "{}: scale {} for {} rows", op,
             scale->describe(), d.m);
  return d;
}
}  // namespace

RowsDims check_gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, const Tensor& dst) {
  return check_rows(src, dst, rows, scale, "gather_rows");
}

RowsDims check_scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, const Tensor& dst) {
  return check_rows(dst, src, rows, scale, "scatter_add_rows");
}

int64_t check_rows_dot(const Tensor& a, const Tensor& b, const Tensor& out) {
  check_same(a, b, "rows_dot b");
  const int64_t m = rows_of(a);
  FP_CHECK(out.numel() == m && out.dtype() == a.dtype(), "rows_dot out {} for {}", out.describe(), a.describe());
  return m;
}

void check_row_id(int32_t id, int64_t n, int64_t at, const char* op) {
  FP_CHECK(id >= 0 && id < n, "{}: row id {} at index {} outside [0, {})", op, id, at, n);
}

}  // namespace foldpar
