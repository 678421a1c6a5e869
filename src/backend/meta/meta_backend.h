// MetaBackend: the Backend of a dry run (docs/design.md, Planning / dry run). Every op
// validates its arguments as the real backends do (backend/op_checks.h and the same
// per-op rules), touches no tensor data (inputs and outputs are normally storage-less
// tensors: MemoryTracker::make_storageless) and appends one OpRecord: the op, its place in
// program order (an EventOrder shared with the counting communicators), FLOPs in
// model/flop_count.h's conventions, bytes read and written, dtype and shape class.
// Scalar-returning ops (sum_squares, cross_entropy_forward) return 0.
//
// Adding a Backend op here: one override that runs the op's check and calls record() with
// its name, shape class, FLOPs and bytes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "core/event_order.h"

namespace foldpar {

// The shape class an op is priced by; fields not used by its kind stay 0.
struct OpShape {
  enum class Kind : uint8_t { kMatmul, kAttention, kTokenwise };
  Kind kind = Kind::kTokenwise;
  int64_t m = 0, n = 0, k = 0;                                  // matmul: op(a) [M, K], op(b) [K, N]
  int64_t batch = 0, sq = 0, sk = 0, n_h = 0, n_kv = 0, d = 0;  // attention
  int64_t rows = 0, width = 0;                                  // token-wise: x viewed as [rows, width]
};

struct OpRecord {
  uint64_t seq = 0;        // EventOrder number: merges with the communicators' records
  std::string_view op;     // the Backend method's name: "matmul", "attention_forward", ...
  DType dtype = DType::kF32;  // of the op's main operand
  OpShape shape;
  double flops = 0;        // matmul 2*M*N*K; attention 4*d (fwd) or 8*d (bwd) per visible pair and head
  int64_t bytes_read = 0;  // every input tensor once, accumulated outputs included
  int64_t bytes_written = 0;
  // Attention: whether the visible pairs were counted from the positions (they had
  // storage) or, positions being storage-less, taken as every (query, key) pair.
  bool pairs_exact = true;
};

struct MetaBackendOptions {
  EventOrder* order = nullptr;      // shared program order; null: a private counter
  bool matmul_takes_bf16 = false;   // what Backend::matmul_takes_bf16 answers
  // Allocate, for the duration of each attention call, the scratch the CPU flash attention
  // takes (cpu_flash_attention_scratch, backend/op_checks.h), so that tracked peaks equal a
  // CPU run's. Off: ops allocate nothing (a backend whose scratch is not tracked).
  bool cpu_attention_scratch = true;
  // The routing moe_route_forward assumes (planned_moe_routing): 1 balanced; X > 1 gives
  // expert 0 X times its balanced share.
  double moe_imbalance = 1.0;
};

// The routing a dry run assumes, since it has no data to route (docs/design.md, Planning /
// dry run, MoE): the experts [T, k] (row-major, i32) of T tokens' top-k. Balanced
// (imbalance 1): slot i of token t goes to expert (t*k + i) mod E, so each expert receives
// T*k/E rows (+-1) and, every rank routing its T tokens the same way, each rank sends
// T*k/D rows to each rank. imbalance X > 1 (needs k < E): the first min(T, round(X*T*k/E))
// tokens take expert 0 in their first slot and every other slot goes round-robin over
// experts 1..E-1 (skipping one already in the token), so expert 0 is the busiest, X times
// the balanced share, and the others share the rest evenly (+-1). Deterministic; the same
// on every rank. Callers validate: 1 <= k <= E, imbalance >= 1 (and k < E when > 1).
std::vector<int32_t> planned_moe_routing(int64_t T, int64_t k, int64_t E, double imbalance);

class MetaBackend final : public Backend {
 public:
  explicit MetaBackend(MetaBackendOptions options = {});
  std::string_view name() const override { return "meta"; }
  const std::vector<OpRecord>& records() const { return records_; }
  double total_flops() const;

  void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, float alpha = 1.0f,
              float beta = 0.0f) override;
  bool matmul_takes_bf16() const override { return options_.matmul_takes_bf16; }
  // As the CPU backend: token-wise ops take bf16 where its matmul does.
  bool tokenwise_takes_bf16() const override { return options_.matmul_takes_bf16; }
  void copy(const Tensor& src, Tensor& dst) override;
  void add_inplace(const Tensor& x, Tensor& y) override;
  void scale_inplace(double alpha, Tensor& y) override;
  void fill(double value, Tensor& y) override;
  double sum_squares(const Tensor& x) override;
  void adamw_update(const AdamWStep& s, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) override;
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
  void copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) override;
  // Keeps the bytes of i32 uploads (positions, token ids: small and host-made) beside the
  // storage-less tensor, so attention counts its visible pairs exactly (see host_i32_).
  void copy_from_host(std::span<const std::byte> src, Tensor& dst) override;
  // Writes zeros: a dry run computes nothing (ids read back are valid, sampled logits flat).
  void copy_to_host(const Tensor& src, std::span<std::byte> dst) override;
  void attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) override;
  void softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) override;
  // Every row counts as valid (nothing is ignored in a dry run's batch): loss_sum 0.
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

  // A counting communicator's all_gather (all_to_all) of `bytes_per_rank` per rank between
  // storage-less buffers, under the dry run's assumption that every rank holds what this
  // one does (the same routing everywhere): recv's known contents become `size` copies of
  // send's (of send's block `rank`, which is what every rank sends this one). Unknown
  // contents stay unknown (read back as zeros).
  void deliver_collective(bool all_to_all, const void* send, void* recv, size_t bytes_per_rank, int rank, int size);

 private:
  // The uploaded i32 contents a storage-less tensor (or view) at `t` holds, or null.
  const int32_t* known_i32(const Tensor& t) const;
  // The known words of an i32 or i64 tensor (i64: two words per element), or null.
  const int32_t* known_words(const Tensor& t) const;
  const int32_t* known_range(const std::byte* p, size_t nbytes) const;
  void forget_written(const Tensor& t);
  void forget_range(const std::byte* p, size_t nbytes);
  // Appends a record; reads and writes are the tensors' byte sizes summed.
  OpRecord& record(std::string_view op, DType dtype, OpShape shape, double flops,
                   std::initializer_list<const Tensor*> read, std::initializer_list<const Tensor*> written);
  OpRecord& record_tokenwise(std::string_view op, const Tensor& x, double flops,
                             std::initializer_list<const Tensor*> read, std::initializer_list<const Tensor*> written);
  void attention(std::string_view op, const AttentionArgs& args, const Tensor& out, const Tensor& lse,
                 double flops_per_pair_and_head, std::initializer_list<const Tensor*> read,
                 std::initializer_list<const Tensor*> written);

  MetaBackendOptions options_;
  EventOrder own_order_;
  std::vector<OpRecord> records_;
  // Start address -> the i32 words (i64 values: two each) copy_from_host, the routing or a
  // delivered collective wrote there; an entry is dropped when
  // another op writes into its range. Lookups find the entry a view's address falls in.
  std::map<const std::byte*, std::vector<int32_t>> host_i32_;
};

std::unique_ptr<MetaBackend> make_meta_backend(MetaBackendOptions options = {});

}  // namespace foldpar
