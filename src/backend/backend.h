// Backend: the one interface through which model math touches tensor data. Two CPU
// implementations sit behind it (backend/cpu/): the reference backend (plain loops, fp64
// accumulation, f32 and f64 tensors; the ground truth) and the fast backend (oneDNN or
// OpenBLAS GEMMs chosen per shape by cpu/gemm_engine.h, blocked flash attention, vectorized
// elementwise kernels; f32, and bf16 matmul operands where the CPU multiplies bf16). The
// CUDA backend (backend/cuda/cuda_backend.h, built with FOLDPAR_WITH_CUDA) implements the
// same ops on one GPU, f32 or bf16 storage with f32 arithmetic. Backends know nothing about parallelism.
//
// Conventions for every op:
//  - Tensors are contiguous row-major. "T" is a count of token rows (B*S, or a rank's local
//    tokens); an op that says [T, h] accepts any rank >= 2 whose last extent is h.
//  - Outputs are passed as `Tensor&` and must be allocated by the caller with the stated shape
//    and the inputs' dtype. "written" outputs are overwritten; "accumulated" ones get +=.
//  - Token ids and positions are i32.
//  - Shape or dtype mismatches are bugs in the caller: they fail an FP_CHECK.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "tensor/tensor.h"

namespace foldpar {

// Arguments of causal attention with explicit global positions: key j is visible to query i
// iff k_pos[j] <= q_pos[i], and with a sliding window W > 0 also q_pos[i] - k_pos[j] < W
// (Mistral's window: the W most recent positions, the query's own included). Positions need
// not be contiguous or sorted (a TSP rank holds two zigzag chunks); the rule is on positions
// alone, so every layout and the KV cache get the window for free. A query that sees no key
// gets output 0 and lse -inf.
struct AttentionArgs {
  const Tensor* q = nullptr;      // [B, Sq, n_h, d]
  const Tensor* k = nullptr;      // [B, Sk, n_kv, d], n_h % n_kv == 0 (GQA: head i uses kv head i / (n_h/n_kv))
  const Tensor* v = nullptr;      // [B, Sk, n_kv, d]
  const Tensor* q_pos = nullptr;  // i32 [Sq]: global position of each query row (same for every batch)
  const Tensor* k_pos = nullptr;  // i32 [Sk]
  double scale = 0;               // softmax scale, usually 1/sqrt(d)
  int64_t window = 0;             // sliding window W >= 0 in positions; 0: full causal
};

// A block of a row-major matrix: `rows` rows of `cols` elements, element (i, j) at
// offset + i * row_stride + j of a tensor's flat storage (in elements of its dtype).
struct StridedBlock {
  int64_t offset = 0;
  int64_t row_stride = 0;
};
struct StridedCopy {
  int64_t rows = 0, cols = 0;
  StridedBlock src, dst;
};

// The cross-entropy of rows whose softmax statistics are complete (Backend::cross_entropy_finish).
struct LossSums {
  double loss_sum = 0;       // sum over valid rows of lse - target_logit, in f64, in row order
  int64_t valid_tokens = 0;  // rows whose target is not ignore_index
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // ---- linear algebra ----
  // c = alpha * op(a) op(b) + beta * c, where op transposes when asked. Each operand is viewed
  // as 2-D [numel / last extent, last extent] (reshape [B, S, n, d] to [B*S, n*d] first):
  // op(a) [M, K], op(b) [K, N], c [M, N]. With beta == 0
  // c is written (its old contents, even NaN, are ignored).
  virtual void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                      float alpha = 1.0f, float beta = 0.0f) = 0;
  // Whether matmul also takes bf16 a and b (c bf16 or f32), multiplying bf16 x bf16 with f32
  // accumulation at bf16 speed. Where false, bf16 operands must be widened first; the bf16
  // storage decorator asks before it widens. Where true, attention_forward/backward take
  // bf16 q, k, v too (out, d_out, dq, dk, dv bf16; lse f32 or bf16): bf16 products, f32 softmax.
  virtual bool matmul_takes_bf16() const { return false; }
  // Whether the token-wise ops add_inplace, rmsnorm_forward/backward, rope_forward/backward
  // and swiglu_forward/backward take bf16 tensors in any operand (rstd and the rope table
  // stay f32): f32 arithmetic on the widened values, each bf16 output rounded once, the
  // same bits as the bf16 storage decorator's widened f32 call. Where true the decorator
  // passes them as they are, with no workspace copies.
  virtual bool tokenwise_takes_bf16() const { return false; }

  // ---- elementwise ----
  // dst written, same numel; the same dtype, or one f32 and the other bf16: the value
  // converted (to bf16 rounded to nearest even, exactly as f32_to_bf16), which is how the
  // bf16 storage decorator widens and narrows through the backend.
  virtual void copy(const Tensor& src, Tensor& dst) = 0;
  virtual void add_inplace(const Tensor& x, Tensor& y) = 0;          // y += x (same numel)
  virtual void scale_inplace(double alpha, Tensor& y) = 0;           // y *= alpha
  virtual void fill(double value, Tensor& y) = 0;
  // Sum of squares of all elements, accumulated in f64.
  virtual double sum_squares(const Tensor& x) = 0;
  // Block copy within or between tensors of one dtype (any dtype, f32 to i32: bytes move
  // unchanged): dst[c.dst.offset + i * c.dst.row_stride + j] = src[c.src.offset + i *
  // c.src.row_stride + j] for i < rows, j < cols; the rest of dst untouched. Every addressed
  // element must lie inside its tensor; the two blocks must not overlap. Row copies,
  // gathers of row ranges, column blocks of a matrix and KV cache slots are all this op.
  virtual void copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) = 0;
  // The host boundary: the bytes of `src` (exactly dst.nbytes()) into dst (written), and
  // the bytes of `src` into host memory `dst` (exactly src.nbytes()). Token ids, positions
  // and RoPE tables made on the host go in; the logits sampled on the host and scalars
  // come out. Ordered with the ops before and after, as a copy is.
  virtual void copy_from_host(std::span<const std::byte> src, Tensor& dst) = 0;
  virtual void copy_to_host(const Tensor& src, std::span<std::byte> dst) = 0;

  // ---- optimizer ----
  // One AdamW step on a parameter (decoupled weight decay, bias-corrected moments):
  //   g = grad * grad_scale;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
  //   param -= lr * (m / (1-b1^step) / (sqrt(v / (1-b2^step)) + eps) + weight_decay * param)
  // param, m, v updated in place (all f32, same numel as grad); step >= 1.
  struct AdamWStep {
    double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
    double grad_scale = 1;  // gradient clipping folds in here
    int64_t step = 1;
  };
  virtual void adamw_update(const AdamWStep& s, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) = 0;

  // ---- many tensors at once (one kernel launch each on the CUDA backend) ----
  // Each is the single-tensor op above on every tensor in order, with the same arithmetic per
  // element: the defaults (backend.cc) loop over the single-tensor op, so every backend
  // is correct without overriding them; decorators forward them; the CUDA backend runs each
  // in one launch. Tensors may have any numel, 0 included, and may differ in dtype as the
  // single-tensor op allows; they must not overlap.
  // fill(value, *y) for every y.
  virtual void fill_many(double value, std::span<Tensor* const> ys);
  // out[i] = sum_squares(*xs[i]) (out.size() == xs.size()). Synchronizes where sum_squares
  // does. The CUDA backend sums per-block f32 partials into each tensor's f64 total in no
  // fixed order (so do its single-tensor sums, over other blocks): equal to sum_squares there
  // within f32 rounding of the partials, not bit for bit; elsewhere bit for bit.
  virtual void sum_squares_many(std::span<const Tensor* const> xs, std::span<double> out);
  // One parameter of adamw_update_many: adamw_update's operands, whether weight decay
  // applies (s.weight_decay where true, 0 where false), and where set, `rounded`: after the
  // update, copy(*param, *rounded) (the bf16 parameter of an f32 master: same numel, written
  // as copy converts, so the rounding of every bf16 parameter rides in the same call).
  struct AdamWTensors {
    const Tensor* grad = nullptr;
    Tensor* param = nullptr;
    Tensor* m = nullptr;
    Tensor* v = nullptr;
    bool decay = true;
    Tensor* rounded = nullptr;
  };
  virtual void adamw_update_many(const AdamWStep& s, std::span<const AdamWTensors> ts);

  // ---- embedding ----
  // table holds vocabulary rows [vocab_offset, vocab_offset + V_local). Rows of `out` whose id
  // falls in that range are written with the table row; other rows are left untouched.
  // ids: i32 [T]; table: [V_local, h]; out: [T, h].
  virtual void embedding_forward(const Tensor& ids, const Tensor& table, int64_t vocab_offset, Tensor& out) = 0;
  // d_table (accumulated) [V_local, h] += d_out rows of the ids in range.
  virtual void embedding_backward(const Tensor& ids, const Tensor& d_out, int64_t vocab_offset,
                                  Tensor& d_table) = 0;

  // ---- RMSNorm (Hugging Face LlamaRMSNorm) ----
  // y = x / sqrt(mean(x^2) + eps) * w. x, y: [T, h]; w: [h]; rstd (written): [T], the
  // 1/sqrt(mean(x^2)+eps) kept for backward.
  virtual void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) = 0;
  // dx written [T, h]; dw accumulated [h].
  virtual void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                                Tensor& dx, Tensor& dw) = 0;

  // ---- RoPE (Hugging Face convention, rotate_half) ----
  // x: [B, S, n, d], rotated in place; table: [S, 2, d/2], the cos then sin of each row position's angles
  // (build it with build_rope_table, backend/rope_table.h). Backward rotates by the negative
  // angle (the transpose), also in place.
  virtual void rope_forward(const Tensor& table, Tensor& x) = 0;
  virtual void rope_backward(const Tensor& table, Tensor& dx) = 0;

  // ---- causal attention ----
  // out (written): [B, Sq, n_h, d]; lse (written): [B, n_h, Sq], the log-sum-exp of the scaled
  // visible scores of each query row, in the tensors' dtype.
  virtual void attention_forward(const AttentionArgs& args, Tensor& out, Tensor& lse) = 0;
  // From the forward's out and lse: dq [B, Sq, n_h, d], dk and dv [B, Sk, n_kv, d], all written.
  virtual void attention_backward(const AttentionArgs& args, const Tensor& out, const Tensor& lse,
                                  const Tensor& d_out, Tensor& dq, Tensor& dk, Tensor& dv) = 0;
  // The online-softmax merge of a partial result over another set of keys into (out, lse),
  // both accumulated: per query row and head, with a = lse, c = block_lse:
  //   c == -inf: unchanged;  a == -inf: out = block_out, lse = c;
  //   else, m = max(a, c) (f64): out = wa out + wc block_out, lse = m + log(e^(a-m) + e^(c-m)),
  //   wa, wc = e^(a-m), e^(c-m) over their sum, rounded to the tensors' dtype.
  // out, block_out: [B, Sq, n_h, d]; lse, block_lse: [B, n_h, Sq] (attention_forward's layout).
  virtual void attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) = 0;

  // ---- SiLU-gated MLP pieces ----
  // out = silu(gate) * up; all [T, f].
  virtual void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  // d_gate, d_up written [T, f].
  virtual void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, Tensor& d_gate,
                               Tensor& d_up) = 0;

  // ---- mixture of experts (model/moe_layer.h) ----
  // The Hugging Face routing of token rows: p = softmax(logits) over the E experts (f64
  // arithmetic); experts[t, :] = the k largest p[t, e] in descending order, ties to the
  // lower expert index; weights[t, j] = p[t, experts[t, j]], divided by their row sum when
  // `normalize`. logits, probs (written): [T, E]; weights (written): [T, k]; experts
  // (written): i32 [T, k], 1 <= k <= E.
  virtual void moe_route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights,
                                 Tensor& experts) = 0;
  // d_logits (written) [T, E]: the gradient through the softmax of d_weights [T, k] (through
  // the renormalisation when `normalize`) plus, when d_probs_bias is given, the same
  // d_probs_bias[e] on every p[t, e] (the auxiliary loss's, [E]).
  struct MoeRouteGrad {
    const Tensor* probs = nullptr;         // [T, E] from moe_route_forward
    const Tensor* weights = nullptr;       // [T, k]
    const Tensor* experts = nullptr;       // i32 [T, k]
    const Tensor* d_weights = nullptr;     // [T, k]
    const Tensor* d_probs_bias = nullptr;  // [E] or null
    bool normalize = false;
  };
  virtual void moe_route_backward(const MoeRouteGrad& g, Tensor& d_logits) = 0;
  // dst[i, :] (written) = scale[i] * src[rows[i], :] (scale null: 1). src: [N, w]; rows:
  // i32 [M], each in [0, N); scale: [M]; dst: [M, w]. Dispatch of tokens to experts.
  virtual void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) = 0;
  // dst[rows[i], :] += scale[i] * src[i, :] (accumulated), in increasing i (scale null: 1).
  // src: [M, w]; rows: i32 [M], each in [0, N); scale: [M]; dst: [N, w]. The combine.
  virtual void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) = 0;
  // out[i] (written) = sum_j a[i, j] * b[i, j], accumulated in f64. a, b: [M, w]; out: [M].
  virtual void rows_dot(const Tensor& a, const Tensor& b, Tensor& out) = 0;
  // y = 1 / (1 + exp(-x)), and dx = dy * y * (1 - y) from the forward's y; all the same
  // shape, written (the shared expert's gate).
  virtual void sigmoid_forward(const Tensor& x, Tensor& y) = 0;
  virtual void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) = 0;

  // ---- cross-entropy ----
  // logits [T, V]; targets i32 [T] (ignore_index marks tokens without a loss). Writes lse [T]
  // (0 for ignored rows) and returns the SUM of -log softmax(logits)[target] over valid rows,
  // so that callers (possibly on many ranks) divide by the global valid count.
  virtual double cross_entropy_forward(const Tensor& logits, const Tensor& targets, int32_t ignore_index,
                                       Tensor& lse) = 0;
  // logits may be the columns [vocab_offset, vocab_offset + Vc) of the full logits (a
  // vocabulary shard): d_logits (written, may be the same tensor as logits) =
  // (exp(logits - lse) - onehot(target)) * grad_scale for valid rows (the one-hot only where
  // the target falls in the shard), 0 for ignored rows. lse [T] is the log-sum-exp over the
  // FULL vocabulary; grad_scale is d(loss)/d(sum), e.g. 1 / valid_count.
  virtual void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                      int64_t vocab_offset, int32_t ignore_index, double grad_scale,
                                      Tensor& d_logits) = 0;
  // The online log-sum-exp over vocabulary shards: logits [T, Vc] are the columns
  // [vocab_offset, vocab_offset + Vc). Updates row_max and row_sum [T] (start at -inf and 0)
  // so that after every shard lse = row_max + log(row_sum), and writes target_logit[t] for
  // the valid rows whose target falls in this shard (other rows untouched).
  virtual void softmax_chunk_update(const Tensor& logits, const Tensor& targets, int64_t vocab_offset,
                                    int32_t ignore_index, Tensor& row_max, Tensor& row_sum,
                                    Tensor& target_logit) = 0;
  // Moves softmax_chunk_update's sums from a local to a global row maximum before they are
  // summed over shards: row_sum[t] *= exp(local_max[t] - global_max[t]), in the tensors'
  // dtype. All [T]; row_sum accumulated in place.
  virtual void softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) = 0;
  // The loss from complete statistics: lse[t] = row_max[t] + log(row_sum[t]) (written, [T],
  // in the tensors' dtype, every row), and the LossSums over the valid rows (the f64 sum of
  // lse - target_logit taken in row order). row_max, row_sum, target_logit: [T]; targets i32 [T].
  virtual LossSums cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                        const Tensor& targets, int32_t ignore_index, Tensor& lse) = 0;
  // Number of targets (i32, any shape) that are not ignore_index.
  virtual int64_t count_valid_targets(const Tensor& targets, int32_t ignore_index) = 0;
};

// The reference CPU backend: plain loops with fp64 accumulation; f32 and f64 tensors.
std::unique_ptr<Backend> make_reference_backend();
// The fast CPU backend: oneDNN/OpenBLAS GEMMs (backend/cpu/gemm_engine.h), blocked flash
// attention, vectorized kernels; f32 tensors (and bf16 matmul operands: matmul_takes_bf16).
std::unique_ptr<Backend> make_cpu_backend();

// The fast CPU backend's GEMM engine in one line (gemm_engine_report().summary()) and its
// warning, empty unless something runs below the machine's rate: what `foldpar bench`
// prints and metrics.jsonl records.
std::string cpu_gemm_engine_summary();
std::string cpu_gemm_engine_warning();

// Threads the CPU backend's GEMM libraries (OpenBLAS and oneDNN) may use (1 when ranks share
// cores). Process-wide, as the libraries' own settings are.
void set_cpu_backend_threads(int threads);

}  // namespace foldpar
