// MetaBackend: each op's checks (those of the real backends), then one record; no data.
#include "backend/meta/meta_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
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
// k_pos[j] <= q_pos[i] and, with a sliding window W > 0, q_pos[i] - k_pos[j] < W.
// Positions span a range about as long as the sequence, so a prefix count of the keys over
// that range answers each query in O(1): O(nq + nk + range) per call instead of sorting the
// keys (the plan of a 128K-token layout calls this some 10^4 times). Positions spread far
// wider than the keys fall back to sorting.
int64_t visible_pairs(const int32_t* q, int64_t nq, const int32_t* kp, int64_t nk, int64_t window) {
  if (nq == 0 || nk == 0) return 0;
  const auto [kmin_it, kmax_it] = std::minmax_element(kp, kp + nk);
  const int64_t kmin = *kmin_it, kmax = *kmax_it, range = kmax - kmin + 1;
  // keys at or below position p, for any p (clamped to the keys' range)
  if (range <= 4 * (nk + nq) + 1024) {
    std::vector<int64_t> below(static_cast<size_t>(range) + 1, 0);  // below[i]: keys < kmin + i
    for (int64_t j = 0; j < nk; ++j) ++below[static_cast<size_t>(kp[j] - kmin + 1)];
    for (size_t i = 1; i < below.size(); ++i) below[i] += below[i - 1];
    auto at_most = [&](int64_t p) -> int64_t {
      if (p < kmin) return 0;
      if (p > kmax) return nk;
      return below[static_cast<size_t>(p - kmin + 1)];
    };
    int64_t pairs = 0;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t qi = q[i];
      pairs += at_most(qi) - (window > 0 ? at_most(qi - window) : 0);
    }
    return pairs;
  }
  std::vector<int64_t> k(kp, kp + nk);
  std::sort(k.begin(), k.end());
  int64_t pairs = 0;
  for (int64_t i = 0; i < nq; ++i) {
    const auto hi = std::upper_bound(k.begin(), k.end(), int64_t{q[i]});
    const auto lo = window > 0 ? std::lower_bound(k.begin(), hi, int64_t{q[i]} - window + 1) : k.begin();
    pairs += hi - lo;
  }
  return pairs;
}

const std::byte* address_of(const Tensor& t) { return static_cast<const std::byte*>(t.raw_data()); }

// The most integer words kept per tensor: bounded memory for long sequences.
constexpr size_t kMaxKeptInts = size_t{1} << 22;

}  // namespace

std::vector<int32_t> planned_moe_routing(int64_t T, int64_t k, int64_t E, double imbalance) {
  std::vector<int32_t> out(static_cast<size_t>(T * k));
  if (imbalance <= 1.0 || k >= E) {
    for (int64_t p = 0; p < T * k; ++p) out[static_cast<size_t>(p)] = static_cast<int32_t>(p % E);
    return out;
  }
  const int64_t heavy = std::min<int64_t>(T, std::llround(imbalance * static_cast<double>(T * k) / static_cast<double>(E)));
  int64_t cursor = 0;  // round-robin over experts 1..E-1
  for (int64_t t = 0; t < T; ++t) {
    int32_t* row = out.data() + t * k;
    int64_t i = 0;
    if (t < heavy) row[i++] = 0;
    const int64_t first = i;
    for (; i < k; ++i) {
      int32_t e = static_cast<int32_t>(1 + cursor % (E - 1));
      // distinct within the token: k - first <= E - 1 slots from E - 1 experts
      while (std::find(row + first, row + i, e) != row + i) e = static_cast<int32_t>(1 + (e % (E - 1)));
      row[i] = e;
      ++cursor;
    }
  }
  return out;
}

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
  // A copy of known contents (a view of uploaded positions) stays known.
  const int32_t* known = dst.has_storage() ? nullptr : known_words(src);
  std::vector<int32_t> values;
  if (known != nullptr) values.assign(known, known + src.nbytes() / sizeof(int32_t));
  forget_written(dst);
  if (known != nullptr) host_i32_[address_of(dst)] = std::move(values);
  record_tokenwise("copy", src, 0, {&src}, {&dst});
}

void MetaBackend::add_inplace(const Tensor& x, Tensor& y) {
  check_add_inplace(x, y, tokenwise_takes_bf16());
  check_floating(x, "add_inplace");
  record_tokenwise("add_inplace", y, 0, {&x, &y}, {&y});
}

void MetaBackend::scale_inplace(double /*alpha*/, Tensor& y) {
  check_floating(y, "scale_inplace");
  record_tokenwise("scale_inplace", y, 0, {&y}, {&y});
}

void MetaBackend::fill(double /*value*/, Tensor& y) {
  check_floating(y, "fill");
  forget_written(y);
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
  auto positions = [this](const Tensor& t) -> const int32_t* {
    return t.has_storage() ? t.data<int32_t>() : known_i32(t);
  };
  const int32_t* q = positions(*a.q_pos);
  const int32_t* k = positions(*a.k_pos);
  const bool exact = q != nullptr && k != nullptr;
  const int64_t pairs = exact ? visible_pairs(q, a.q_pos->numel(), k, a.k_pos->numel(), d.window) : d.sq * d.sk;
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

const int32_t* MetaBackend::known_i32(const Tensor& t) const {
  return t.dtype() == DType::kI32 ? known_words(t) : nullptr;
}

const int32_t* MetaBackend::known_words(const Tensor& t) const {
  if ((t.dtype() != DType::kI32 && t.dtype() != DType::kI64)) return nullptr;
  return known_range(address_of(t), t.nbytes());
}

const int32_t* MetaBackend::known_range(const std::byte* p, size_t nbytes) const {
  if (host_i32_.empty() || nbytes % sizeof(int32_t) != 0) return nullptr;
  auto it = host_i32_.upper_bound(p);
  if (it == host_i32_.begin()) return nullptr;
  --it;
  const int64_t offset = (p - it->first) / static_cast<int64_t>(sizeof(int32_t));
  if ((p - it->first) % static_cast<int64_t>(sizeof(int32_t)) != 0) return nullptr;
  if (offset + static_cast<int64_t>(nbytes / sizeof(int32_t)) > static_cast<int64_t>(it->second.size())) return nullptr;
  return it->second.data() + offset;
}

void MetaBackend::forget_range(const std::byte* lo, size_t nbytes) {
  if (host_i32_.empty()) return;
  const std::byte* hi = lo + nbytes;
  for (auto it = host_i32_.begin(); it != host_i32_.end();) {
    const std::byte* end = it->first + it->second.size() * sizeof(int32_t);
    it = (it->first < hi && lo < end) ? host_i32_.erase(it) : std::next(it);
  }
}

void MetaBackend::deliver_collective(bool all_to_all, const void* send, void* recv, size_t bytes_per_rank, int rank,
                                     int size) {
  const std::byte* out = static_cast<const std::byte*>(recv);
  const size_t total = bytes_per_rank * static_cast<size_t>(size);
  // What is not known stays unknown (read back as zeros), as before.
  const int32_t* known = all_to_all ? known_range(static_cast<const std::byte*>(send) + bytes_per_rank * rank, bytes_per_rank)
                                    : known_range(static_cast<const std::byte*>(send), bytes_per_rank);
  std::vector<int32_t> block;
  if (known != nullptr) block.assign(known, known + bytes_per_rank / sizeof(int32_t));
  forget_range(out, total);
  if (known == nullptr || bytes_per_rank == 0) return;
  std::vector<int32_t> all;
  all.reserve(block.size() * static_cast<size_t>(size));
  for (int q = 0; q < size; ++q) all.insert(all.end(), block.begin(), block.end());
  host_i32_[out] = std::move(all);
}

void MetaBackend::forget_written(const Tensor& t) { forget_range(address_of(t), t.nbytes()); }

void MetaBackend::copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) {
  if (!check_copy_strided(src, dst, c)) return;
  forget_written(dst);
  OpShape s;
  s.rows = c.rows;
  s.width = c.cols;
  const int64_t bytes = c.rows * c.cols * static_cast<int64_t>(dtype_size(src.dtype()));
  OpRecord& r = record("copy_strided", src.dtype(), s, 0, {}, {});
  r.bytes_read = bytes;
  r.bytes_written = bytes;
}

void MetaBackend::copy_from_host(std::span<const std::byte> src, Tensor& dst) {
  check_host_copy(dst, src.size(), "copy_from_host");
  dst.count_host_copy(static_cast<int64_t>(src.size()), 0);
  forget_written(dst);
  // Small integer uploads only (positions, ids, the MoE counts): bounded memory for long sequences.
  if ((dst.dtype() == DType::kI32 || dst.dtype() == DType::kI64) && !dst.has_storage() &&
      src.size() / sizeof(int32_t) <= kMaxKeptInts) {
    std::vector<int32_t> v(src.size() / sizeof(int32_t));
    std::memcpy(v.data(), src.data(), src.size());
    host_i32_[address_of(dst)] = std::move(v);
  }
  record_tokenwise("copy_from_host", dst, 0, {}, {&dst});
}

void MetaBackend::copy_to_host(const Tensor& src, std::span<std::byte> dst) {
  check_host_copy(src, dst.size(), "copy_to_host");
  src.count_host_copy(0, static_cast<int64_t>(dst.size()));
  const int32_t* known = src.has_storage() ? nullptr : known_words(src);
  if (known != nullptr && src.nbytes() == dst.size()) {
    std::memcpy(dst.data(), known, dst.size());
  } else {
    std::fill(dst.begin(), dst.end(), std::byte{0});
  }
  record_tokenwise("copy_to_host", src, 0, {&src}, {});
}

void MetaBackend::attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) {
  check_attention_merge(block_out, block_lse, out, lse);
  check_floating(out, "attention_merge");
  record_tokenwise("attention_merge", out, 0, {&block_out, &block_lse, &out, &lse}, {&out, &lse});
}

void MetaBackend::softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) {
  check_softmax_rescale(local_max, global_max, row_sum);
  check_floating(row_sum, "softmax_rescale");
  OpShape s;
  s.rows = row_sum.numel();
  s.width = 1;
  record("softmax_rescale", row_sum.dtype(), s, 0, {&local_max, &global_max, &row_sum}, {&row_sum});
}

LossSums MetaBackend::cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                           const Tensor& targets, int32_t /*ignore_index*/, Tensor& lse) {
  const int64_t n = check_cross_entropy_finish(row_max, row_sum, target_logit, targets, lse);
  check_floating(lse, "cross_entropy_finish");
  OpShape s;
  s.rows = n;
  s.width = 1;
  record("cross_entropy_finish", lse.dtype(), s, 0, {&row_max, &row_sum, &target_logit, &targets}, {&lse});
  return LossSums{.loss_sum = 0, .valid_tokens = n};
}

int64_t MetaBackend::count_valid_targets(const Tensor& targets, int32_t /*ignore_index*/) {
  check_targets(targets);
  OpShape s;
  s.rows = targets.numel();
  s.width = 1;
  record("count_valid_targets", targets.dtype(), s, 0, {&targets}, {});
  return targets.numel();
}

// The MoE ops: checks, then records priced as token-wise passes; the gathers and scatters
// count the rows they move, not the whole indexed tensor.
void MetaBackend::moe_route_forward(const Tensor& logits, bool /*normalize*/, Tensor& probs, Tensor& weights,
                                    Tensor& experts) {
  check_moe_route_forward(logits, probs, weights, experts);
  check_floating(logits, "moe_route_forward");
  forget_written(experts);
  // The routing a dry run assumes (planned_moe_routing), readable by copy_to_host.
  const int64_t T = experts.dim(0), k = experts.dim(1), E = logits.dim(1);
  if (!experts.has_storage() && static_cast<size_t>(T * k) <= kMaxKeptInts)
    host_i32_[address_of(experts)] = planned_moe_routing(T, k, E, options_.moe_imbalance);
  record_tokenwise("moe_route_forward", logits, 0, {&logits}, {&probs, &weights, &experts});
}
void MetaBackend::moe_route_backward(const MoeRouteGrad& g, Tensor& d_logits) {
  check_moe_route_backward(g, d_logits);
  check_floating(d_logits, "moe_route_backward");
  record_tokenwise("moe_route_backward", d_logits, 0, {g.probs, g.weights, g.experts, g.d_weights}, {&d_logits});
}
void MetaBackend::gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) {
  check_gather_rows(src, rows, scale, dst);
  check_floating(src, "gather_rows");
  record_tokenwise("gather_rows", dst, 0, {&dst, &rows}, {&dst});
}
void MetaBackend::scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) {
  check_scatter_add_rows(src, rows, scale, dst);
  check_floating(src, "scatter_add_rows");
  record_tokenwise("scatter_add_rows", src, 2.0 * static_cast<double>(src.numel()), {&src, &rows, &src}, {&src});
}
void MetaBackend::rows_dot(const Tensor& a, const Tensor& b, Tensor& out) {
  check_rows_dot(a, b, out);
  check_floating(a, "rows_dot");
  record_tokenwise("rows_dot", a, 2.0 * static_cast<double>(a.numel()), {&a, &b}, {&out});
}
void MetaBackend::sigmoid_forward(const Tensor& x, Tensor& y) {
  check_same(x, y, "sigmoid y");
  check_floating(x, "sigmoid");
  record_tokenwise("sigmoid_forward", x, 0, {&x}, {&y});
}
void MetaBackend::sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  check_same(y, dy, "sigmoid_backward dy");
  check_same(y, dx, "sigmoid_backward dx");
  check_floating(y, "sigmoid_backward");
  record_tokenwise("sigmoid_backward", y, 0, {&y, &dy}, {&dx});
}

}  // namespace foldpar
