// TspStep: construction and the communication helpers shared by the TSP schedules.
#include "parallel/tsp/tsp_step.h"

#include <chrono>

#include "backend/rope_table.h"
#include "model/weight_grad_queue.h"
#include "parallel/kv_exchange.h"

namespace foldpar::tsp_detail {

TspStep::TspStep(const TspModel& model, Backend& backend, Communicator& comm, int64_t batch)
    : model_(model),
      c_(model.config()),
      dims_(model.dims()),
      opt_(model.options()),
      be_(backend),
      comm_(comm),
      batch_(batch),
      local_seq_(model.shard().local_seq()),
      rows_(batch * model.shard().local_seq()),
      p_(comm.rank()),
      D_(comm.size()) {
  FP_CHECK(D_ == dims_.degree && p_ == model.shard().rank(), "TSP model for rank {} of {} on communicator {}",
           model.shard().rank(), dims_.degree, comm.describe());
  // KV replicas: the rank's one KV head is every bucket's (bucket_kv0 0 for all).
  kvh_b_ = dims_.replicated_kv() ? dims_.kv_heads : dims_.kv_heads / opt_.head_buckets;
  heads_b_ = dims_.heads / opt_.head_buckets;
  const std::vector<int32_t>& local = model.shard().positions();
  const std::vector<int32_t> all = model.shard().gathered_positions();
  q_pos_ = Tensor::empty({local_seq_}, DType::kI32, MemCategory::kActivations);
  k_pos_ = Tensor::empty({model.shard().seq()}, DType::kI32, MemCategory::kActivations);
  be_.copy_from_host(std::as_bytes(std::span<const int32_t>(local)), q_pos_);
  be_.copy_from_host(std::as_bytes(std::span<const int32_t>(all)), k_pos_);
  gathered_pos_ = all;
  rope_ = build_rope_table(be_, local, c_.rope_spec(), model.shard().seq(), DType::kF32);
  ctx_ = BlockContext{&c_, &be_, batch_, local_seq_, &q_pos_, &rope_};
  for (int64_t i = 0; i < 2 * c_.num_hidden_layers + 1; ++i) {
    norm_partials_.push_back(Tensor::empty({dims_.h}, DType::kF32, MemCategory::kGradients));
    be_.fill(0.0, norm_partials_.back());
  }
  variant_partials_ = allocate_variant_partials(be_, c_, dims_, /*with_o_bias=*/true);
  if (c_.mlp_bias)
    unit_mlp_bias_grad_ = Tensor::empty({2 * dims_.f_rows + dims_.h}, DType::kF32, MemCategory::kGradients);
  if (c_.qk_norm) unit_norm_grad_ = Tensor::empty({2, dims_.d}, DType::kF32, MemCategory::kGradients);
  if (c_.qkv_bias)
    unit_bias_grad_ = Tensor::empty({(heads_b_ + 2 * kvh_b_) * dims_.d + dims_.h}, DType::kF32, MemCategory::kGradients);
}

TspStep::UnitBiasGrads TspStep::unit_bias_grads() {
  if (!unit_bias_grad_.defined()) return {};
  be_.fill(0.0, unit_bias_grad_);
  const int64_t q = heads_b_ * dims_.d, kv = kvh_b_ * dims_.d;
  const Tensor& t = unit_bias_grad_;
  return {t.narrow(0, q), t.narrow(q, q + kv), t.narrow(q + kv, q + 2 * kv), t.narrow(q + 2 * kv, q + 2 * kv + dims_.h)};
}

TspStep::BucketWeights TspStep::bucket_weights(const Tensor& packed, int bucket) const {
  const AttnPieces a = attn_pieces(dims_, packed);
  const int64_t q0 = bucket * heads_b_ * dims_.d, kv0 = bucket_kv0(bucket) * dims_.d;
  const int64_t qn = heads_b_ * dims_.d, kvn = kvh_b_ * dims_.d;
  return BucketWeights{a.wq.narrow(q0, q0 + qn), a.wk.narrow(kv0, kv0 + kvn), a.wv.narrow(kv0, kv0 + kvn),
                       a.wo_t.narrow(q0, q0 + qn)};
}

MlpWeights TspStep::mlp_chunk(const Tensor& packed) const {
  const MlpPieces m = mlp_pieces(dims_, packed);
  return MlpWeights{m.w_gate, m.w_up, LinearView{m.w_down_t, true}};
}

MlpWeights TspStep::mlp_chunk(const Tensor& packed, const ShardedWeights& w, int l, int step) const {
  MlpWeights m = mlp_chunk(packed);
  attach_mlp_bias(w, l, ring_owner(step) * dims_.f_rows, dims_.f_rows, m);
  if (step == 0 && static_cast<size_t>(l) < w.down_bias.size()) m.down.b = w.down_bias[static_cast<size_t>(l)];
  return m;
}

std::vector<CommRequest> TspStep::start_gather(const Tensor& local, Tensor& full) {
  return start_gather_kv(comm_, local, full);
}

std::vector<CommRequest> TspStep::start_reduce_scatter(const Tensor& full, Tensor& local) {
  return start_reduce_scatter_kv(comm_, full, local);
}

int TspStep::ring_owner(int step) const { return ((p_ - step) % D_ + D_) % D_; }

void TspStep::sum_norm_partials(ShardedWeights& grads) {
  // One all-reduce of every norm gain's partial gradient, packed: [(2L+1) * h].
  foldpar::sum_norm_partials(be_, norm_partials_, grads, [this](Tensor& packed) {
    const auto t0 = std::chrono::steady_clock::now();
    blocking(comm_.all_reduce(packed.raw_data(), packed.raw_data(), static_cast<size_t>(packed.numel()), DType::kF32,
                              ReduceOp::kSum),
             t0);
  });
  // The biases and q/k norms are replicated (every rank computes with every head's, whichever
  // shard it holds): a sum over the axis, not a reduce to an owner.
  foldpar::sum_variant_partials(be_, variant_partials_, grads, [this](Tensor& packed) {
    const auto t0 = std::chrono::steady_clock::now();
    blocking(comm_.all_reduce(packed.raw_data(), packed.raw_data(), static_cast<size_t>(packed.numel()), DType::kF32,
                              ReduceOp::kSum),
             t0);
  });
}

}  // namespace foldpar::tsp_detail

namespace foldpar::tsp_detail {

TspStep::WeightRing TspStep::weight_ring(const Tensor& own, Communicator* axis) {
  return WeightRing{own, Tensor(), CommRequest(), axis != nullptr ? axis : &comm_};
}

void TspStep::weight_ring_send(WeightRing& ring, int step) {
  const int n = ring.axis->size(), p = ring.axis->rank();
  if (step + 1 >= n) return;
  ring.next = comm_buffer(ring.cur.shape(), ring.cur.dtype());
  // The owner's shard is only read: it is never a receive buffer, so it is never overwritten.
  ring.hop = ring.axis->isend_recv(ring.cur.raw_data(), ring.next.raw_data(), static_cast<size_t>(ring.cur.numel()),
                                   ring.cur.dtype(), (p + 1) % n, (p - 1 + n) % n);
  if (!opt_.overlap) wait(ring.hop);
}

void TspStep::weight_ring_advance(WeightRing& ring, int step) {
  if (step + 1 >= ring.axis->size()) return;
  wait(ring.hop);
  ring.cur = std::move(ring.next);
}

Tensor TspStep::grad_ring_partial(Tensor& own_grad, int step, const Shape& shape) {
  if (step == 0) return own_grad;
  // Deferred: step j's products run in W, where step j-1's partial may still be travelling.
  if (ctx_.weight_grads != nullptr) return deferred_partial(deferred_mlp_, step % 2, shape);
  return comm_buffer(shape, own_grad.dtype());
}

void TspStep::grad_ring_send(GradRing& ring, int step, Tensor& partial) {
  if (step == 0) return;
  if (step >= 2) {
    wait(ring.hop);
    be_.add_inplace(ring.incoming, partial);
  }
  ring.sending = partial;
  ring.incoming = comm_buffer(partial.shape(), partial.dtype());
  const int n = ring.axis.size(), p = ring.axis.rank();
  ring.hop = ring.axis.isend_recv(ring.sending.raw_data(), ring.incoming.raw_data(), static_cast<size_t>(partial.numel()),
                             partial.dtype(), (p + 1) % n, (p - 1 + n) % n);
  if (!opt_.overlap) wait(ring.hop);
}

void TspStep::grad_ring_finish(GradRing& ring, Tensor& own_grad) {
  if (ring.axis.size() == 1) return;
  wait(ring.hop);
  be_.add_inplace(ring.incoming, own_grad);
  ring.incoming = Tensor();
  ring.sending = Tensor();
}

void TspStep::reduce_home(CommRequest& request, Tensor& g, int owner) {
  wait(request);
  request = comm_.ireduce(g.raw_data(), owner == p_ ? g.raw_data() : nullptr, static_cast<size_t>(g.numel()),
                          g.dtype(), ReduceOp::kSum, owner);
  if (!opt_.overlap) wait(request);
}

void TspStep::after_products(std::function<void()> work) {
  if (ctx_.weight_grads != nullptr) ctx_.weight_grads->push_action(std::move(work));
  else work();
}

Tensor TspStep::deferred_partial(Tensor (&bufs)[2], int i, const Shape& shape) {
  if (!bufs[i].defined()) bufs[i] = comm_buffer(shape, DType::kF32);
  FP_CHECK(bufs[i].shape() == shape, "deferred partial {} for {}", bufs[i].describe(), shape.to_string());
  return bufs[i];
}

}  // namespace foldpar::tsp_detail
