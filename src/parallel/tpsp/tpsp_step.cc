// TpspStep: construction, the row mappings over tp (f/g or their sequence-parallel forms),
// the sp helpers, the vocabulary-parallel embedding, head and loss, and the sums of a step's
// partial gradients.
//   embedding  fwd: local vocabulary rows, then g (all_reduce) or g' (reduce_scatter) over tp;
//              bwd: g^T (identity, or all_gather) and a scatter into this rank's rows.
//   head       fwd: xf = norm(x), f' with sequence parallelism; the vocabulary-parallel
//              cross-entropy over tp on the sp shard's rows; loss sum and valid count
//              all_reduced over sp. bwd: the partial d_xf through f^T while the LM head's
//              weight gradient computes.
#include <algorithm>
#include <cmath>

#include "backend/rope_table.h"
#include "parallel/tpsp/tpsp_step.h"

namespace foldpar::tpsp_detail {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TpspStep::TpspStep(const TpspModel& model, Backend& backend, const TpspAxes& axes, const Batch& local)
    : model_(model),
      c_(model.config()),
      dims_(model.dims()),
      opt_(model.options()),
      be_(backend),
      tp_(*axes.tp, backend, model.options().overlap),
      sp_(*axes.sp),
      seq_par_(model.options().sequence_parallel),
      gather_(model.options().kv_exchange == LayoutOptions::KvExchange::kAllGather),
      batch_(local.batch()),
      sp_seq_(model.sp_seq()),
      rows_(local.batch() * model.local_seq()),
      all_rows_(local.batch() * model.sp_seq()) {
  FP_CHECK(axes.tp->size() == dims_.degree && axes.tp->rank() == model.tp_rank() &&
               sp_.size() == model.shard().degree() && sp_.rank() == model.shard().rank(),
           "TP x SP model for tp rank {} of {}, sp rank {} of {} on communicators {} and {}", model.tp_rank(),
           dims_.degree, model.shard().rank(), model.shard().degree(), axes.tp->describe(), sp_.describe());
  if (seq_par_) {
    // Every tp rank needs the sp shard's ids (vocabulary-parallel embedding) and targets
    // (the loss runs on every row): one all_gather of both over tp, [B, N/(B T), 2] -> [B, S/S_, 2].
    const int64_t Sl = model.local_seq();
    Tensor packed = Tensor::empty({batch_, Sl, 2}, DType::kI32, MemCategory::kActivations);
    Tensor full = Tensor::empty({batch_, sp_seq_, 2}, DType::kI32, MemCategory::kActivations);
    const int32_t *ids = local.input_ids.data<int32_t>(), *tg = local.target_ids.data<int32_t>();
    int32_t* p = packed.data<int32_t>();
    for (int64_t i = 0; i < rows_; ++i) {
      p[2 * i] = ids[i];
      p[2 * i + 1] = tg[i];
    }
    tp_.all_gather_seq(packed, full);
    ids_ = Tensor::empty({all_rows_}, DType::kI32, MemCategory::kActivations);
    targets_ = Tensor::empty({all_rows_}, DType::kI32, MemCategory::kActivations);
    const int32_t* f = full.data<int32_t>();
    for (int64_t i = 0; i < all_rows_; ++i) {
      ids_.data<int32_t>()[i] = f[2 * i];
      targets_.data<int32_t>()[i] = f[2 * i + 1];
    }
  } else {
    ids_ = local.input_ids.reshape({all_rows_});
    targets_ = local.target_ids.reshape({all_rows_});
  }
  const std::vector<int32_t>& mine = model.shard().positions();
  const std::vector<int32_t> all = model.shard().gathered_positions();
  q_pos_ = Tensor::empty({sp_seq_}, DType::kI32, MemCategory::kActivations);
  k_pos_ = Tensor::empty({model.shard().seq()}, DType::kI32, MemCategory::kActivations);
  std::copy(mine.begin(), mine.end(), q_pos_.data<int32_t>());
  std::copy(all.begin(), all.end(), k_pos_.data<int32_t>());
  rope_ = build_rope_table(mine, dims_.d, c_.rope_theta, DType::kF32);
}

// ---- tp: the row mappings ----

TpComm::Pending TpspStep::start_gather_rows(const Tensor& local, Tensor& full) {
  const int64_t h = dims_.h;
  Tensor f = full.reshape({batch_, sp_seq_, h});
  return tp_.start_all_gather_seq(local.reshape({batch_, model_.local_seq(), h}), f);
}

Tensor TpspStep::gather_rows(const Tensor& local) {
  if (!seq_par_) return local;  // f: identity
  Tensor full = comm_buffer({all_rows_, dims_.h});
  TpComm::Pending p = start_gather_rows(local, full);
  tp_.wait(p);
  return full;
}

TpComm::Pending TpspStep::start_reduce_rows(Tensor& partial, Tensor& out) {
  if (!seq_par_) {
    out = partial;
    return tp_.start_all_reduce(partial);  // g: all_reduce in place
  }
  const int64_t h = dims_.h;
  out = act({rows_, h});
  Tensor o = out.reshape({batch_, model_.local_seq(), h});
  return tp_.start_reduce_scatter_seq(partial.reshape({batch_, sp_seq_, h}), o);
}

Tensor TpspStep::reduce_rows(Tensor& partial) {
  Tensor out;
  TpComm::Pending p = start_reduce_rows(partial, out);
  tp_.wait(p);
  return out;
}

// ---- sp: waits and the K/V exchange ----

void TpspStep::sp_wait(std::vector<CommRequest>& requests) {
  const auto t0 = std::chrono::steady_clock::now();
  for (CommRequest& r : requests) FP_CHECK_OK(r.wait());
  requests.clear();
  sp_wait_seconds_ += seconds_since(t0);
}

void TpspStep::sp_poke(std::vector<CommRequest>& requests) {
  for (CommRequest& r : requests) {
    bool done = false;
    FP_CHECK_OK(r.test(&done));
  }
}

void TpspStep::sp_blocking(const Status& status, std::chrono::steady_clock::time_point t0) {
  FP_CHECK_OK(status);
  sp_wait_seconds_ += seconds_since(t0);
}

// ---- the sums of a step's partial gradients ----

void TpspStep::sum_partials(TpspGrads& partial) {
  if (seq_par_) {
    // The gains saw only this rank's rows of the sp shard: sum over tp first.
    Tensor norms = partial.norm_region();
    tp_.all_reduce(norms);
  }
  // Every gradient saw only this sp rank's tokens. MPI counts are int: a 7B model's
  // gradient slices need several messages.
  constexpr int64_t kMaxElements = int64_t{1} << 30;
  Tensor& flat = partial.flat();
  const int64_t n = flat.numel();
  for (int64_t begin = 0; begin < n; begin += kMaxElements) {
    Tensor chunk = flat.narrow(begin, std::min(n, begin + kMaxElements));
    const auto t0 = std::chrono::steady_clock::now();
    sp_blocking(sp_.all_reduce(chunk.raw_data(), chunk.raw_data(), static_cast<size_t>(chunk.numel()), DType::kF32,
                               ReduceOp::kSum),
                t0);
  }
}

// ---- embedding, head and loss ----

Tensor TpspStep::embed(const ShardedWeights& w) {
  Tensor partial = seq_par_ ? comm_buffer({all_rows_, dims_.h}) : act({all_rows_, dims_.h});
  embedding_partial(be_, tp_.rank(), ids_, w.embed, partial);
  return reduce_rows(partial);  // fwd: g or g'
}

void TpspStep::embed_backward(const Tensor& dx, ShardedWeights& grads) {
  const Tensor dx_full = gather_rows(dx);  // bwd of g: identity; of g': all_gather
  be_.embedding_backward(ids_, dx_full, tp_.rank() * dims_.v_rows, grads.embed);
}

StepResult TpspStep::head_forward(const ShardedWeights& w, const Tensor& x, HeadSaved& hs, Tensor* logits) {
  const int64_t R = rows_, h = dims_.h;
  hs.x_last = x;
  hs.rstd = act({R});
  Tensor xf = act({R, h});
  be_.rmsnorm_forward(x, w.final_norm, c_.rms_norm_eps, xf, hs.rstd);
  hs.xf_full = gather_rows(xf);  // fwd: f or f'
  hs.loss = vocab_parallel_cross_entropy(tp_, hs.xf_full, w.lm_head, targets_);
  if (logits != nullptr) {  // verification only: this rank's rows, every column
    std::vector<int64_t> rows;
    const int64_t Sl = model_.local_seq(), first = seq_par_ ? tp_.rank() * Sl : 0;
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t i = 0; i < Sl; ++i) rows.push_back(b * sp_seq_ + first + i);
    *logits = gather_vocab_logits(tp_, hs.loss.logits, rows);
  }
  // The same sums on every tp rank of the group; over sp they add up to the global batch's.
  double sums[2] = {hs.loss.loss_sum, static_cast<double>(hs.loss.valid_tokens)};
  const auto t0 = std::chrono::steady_clock::now();
  sp_blocking(sp_.all_reduce(sums, sums, 2, DType::kF64, ReduceOp::kSum), t0);
  StepResult r;
  r.loss_sum = sums[0];
  r.valid_tokens = static_cast<int64_t>(sums[1]);
  r.loss = r.valid_tokens > 0 ? r.loss_sum / static_cast<double>(r.valid_tokens) : 0.0;
  return r;
}

Tensor TpspStep::head_backward(const ShardedWeights& w, HeadSaved& hs, int64_t normalizer, ShardedWeights& grads) {
  const int64_t R = rows_, h = dims_.h;
  const double scale = normalizer > 0 ? 1.0 / static_cast<double>(normalizer) : 0.0;
  Tensor d_xf_partial = seq_par_ ? comm_buffer({all_rows_, h}) : act({all_rows_, h});
  vocab_parallel_cross_entropy_backward(be_, tp_.rank(), hs.loss, w.lm_head, targets_, scale, d_xf_partial);
  Tensor d_xf;
  TpComm::Pending req = start_reduce_rows(d_xf_partial, d_xf);  // bwd of f: all_reduce; of f': reduce_scatter
  vocab_parallel_head_weight_grad(be_, hs.loss, hs.xf_full, grads.lm_head);
  tp_.wait(req);
  hs.loss = VocabParallelLoss();
  hs.xf_full = Tensor();
  Tensor dx = act({R, h});
  be_.rmsnorm_backward(hs.x_last, w.final_norm, hs.rstd, d_xf, dx, grads.final_norm);
  return dx;
}

}  // namespace foldpar::tpsp_detail
