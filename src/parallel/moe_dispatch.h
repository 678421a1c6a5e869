// The all-to-all dispatch and combine of a mixture-of-experts layer over an expert axis
// (spec COMPOSITION.md section 3, scheme A), shared by the strategies that shard experts:
// TSP's scheme A (parallel/tsp/tsp_moe.cc, the axis is the TSP axis) and the Megatron
// baselines' expert parallelism (parallel/megatron/tp_moe.cc, the axis is the tp x sp group).
//
// The axis has D ranks; rank q owns dims.experts experts from dims.expert0(q) (ShardDims:
// E/D whole experts, or, when D > E, a 1/(D/E) slice of one expert's f_e). Each rank brings
// its own T token rows, routed as the single-rank layer routes them (model/moe_layer.cc):
// the M = T k dispatched rows sorted by expert, stably (moe_dispatch_order), so the rows for
// rank q's experts are one contiguous block. Forward: the per-expert counts (one all_to_all
// of E/D i64 per peer), each block to its owner (point-to-point, zero-size blocks skipped on
// both sides), the owner regroups them expert-major, runs each expert as one GEMM group,
// regroups back and returns them; split experts' G partial outputs are summed per row.
// Backward: the same two exchanges carry d(out) to the owners and d(in) back.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "model/moe_layer.h"
#include "model/sub_blocks.h"
#include "parallel/sharded_weights.h"
#include "parallel/step_timer.h"

namespace foldpar {

// How a sparse layer's tokens meet their experts (TSP has all three; the Megatron baselines A).
enum class MoeDispatch { kAllToAll, kGather, kRing };
const char* moe_dispatch_name(MoeDispatch d);

// What a sharded sparse layer keeps for backward.
struct MoeShardSaved {
  MoeDispatch scheme = MoeDispatch::kAllToAll;
  NormSaved norm;                          // x_mid, rstd, a2 (the strategy's norm rows)
  MoeSaved route;                          // this rank's routing, dispatch order, combine rows, shared expert
  std::vector<int64_t> send_rows, recv_rows;  // A: rows to / from each rank
  std::vector<int64_t> send_at;            // A: the first dispatched row sent to each rank
  Tensor combine_rows, combine_tokens;     // A, split experts: i32 [D/E * M] each returned row's dispatch row, token
  Tensor to_expert, to_source;             // A: i32 [R] received (source-major) <-> expert-major rows
  std::vector<int64_t> expert_offsets;     // [El + 1] first row of each own (slice of an) expert in expert_in
  Tensor expert_in;                        // [R, h] the rows this rank's experts computed on
  std::vector<MlpSaved> expert_mlp;        // El (dims.experts)
  Tensor g_token, g_slot, g_weight, g_out;  // TSP's B: gathered token / slot of each row, its weight, expert output
  Tensor rows;                             // Megatron, tp without sequence parallelism: i32 this rank's share of the rows
};

// Host values into a communication buffer of the backend (device memory where the
// communicator is NCCL) and back.
template <typename T>
Tensor moe_comm_from_host(Backend& be, const std::vector<T>& v, DType dtype) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, dtype, MemCategory::kComm);
  if (!v.empty()) be.copy_from_host(std::as_bytes(std::span<const T>(v)), t);
  return t;
}
template <typename T>
void moe_comm_to_host(Backend& be, const Tensor& t, std::vector<T>& v) {
  v.resize(static_cast<size_t>(t.numel()));
  if (!v.empty()) be.copy_to_host(t, std::as_writable_bytes(std::span<T>(v)));
}

// Scheme A over one expert axis. Holds references only; made per step (or per layer).
class MoeAllToAll {
 public:
  // comm: the expert axis (its rank and size are dims' expert owner and expert degree);
  // dtype: the storage of what travels and of the activations.
  MoeAllToAll(Backend& be, Communicator& comm, const ShardDims& dims, DType dtype, StepTimer& timer)
      : be_(be), comm_(comm), dims_(dims), dtype_(dtype), timer_(timer), p_(comm.rank()), D_(comm.size()) {}

  // a [T, h] this rank's normed rows; r: their routing (offsets, token_rows, row_weights;
  // token_rows also on the host). Sets r.expert_out [M, h]: each dispatched row's expert
  // output (unweighted, dispatch order); fills s (save: also what backward needs).
  void forward(const BlockContext& ctx, const MoeLayerWeights& mw, const Tensor& a, MoeSaved& r,
               const std::vector<int32_t>& token_rows, MoeShardSaved& s, bool save);
  // d_out [M, h]: d(expert_out) of the dispatched rows (weighted by the routing weights);
  // d_a [T, h] += their input gradient; gw.experts += this rank's experts' gradients (over
  // every row the axis sent them: complete, no sum needed).
  void backward(const BlockContext& ctx, const MoeLayerWeights& mw, const MoeShardSaved& s, const MoeSaved& r,
                const Tensor& d_out, Tensor& d_a, MoeLayerWeights& gw);

  // Rows src in destination blocks to every rank; returns [sum recv_rows, h] in source
  // blocks (point-to-point, zero-size blocks skipped). Rank r's block is at src rows
  // [send_at[r], send_at[r] + send_rows[r]): blocks may overlap (split experts send one
  // expert's rows to each of its D/E ranks).
  Tensor exchange_rows(const Tensor& src, const std::vector<int64_t>& send_at, const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows);
  Tensor exchange_rows(const Tensor& src, const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows);

 private:
  Tensor act(const Shape& shape) const { return Tensor::empty(shape, dtype_, MemCategory::kActivations); }

  Backend& be_;
  Communicator& comm_;
  const ShardDims& dims_;
  DType dtype_;
  StepTimer& timer_;
  int p_, D_;
};

}  // namespace foldpar
