// TpStep: construction, the row mappings (f/g or their sequence-parallel forms) and the
// packed all-reduce of the norm gains' partial gradients.
#include "parallel/tp/tp_step.h"

#include <numeric>

#include "backend/rope_table.h"

namespace foldpar::tp_detail {

TpStep::TpStep(const TpModel& model, Backend& backend, Communicator& tp, const Batch& local)
    : model_(model),
      c_(model.config()),
      dims_(model.dims()),
      opt_(model.options()),
      be_(backend),
      tp_(tp, backend, model.options().overlap),
      sp_(model.options().sequence_parallel),
      batch_(local.batch()),
      seq_(model.seq()),
      rows_(local.batch() * model.local_seq()),
      all_rows_(local.batch() * model.seq()) {
  FP_CHECK(tp.size() == dims_.degree && tp.rank() == model.rank(), "TP model for rank {} of {} on communicator {}",
           model.rank(), dims_.degree, tp.describe());
  if (sp_) {
    // Every rank needs every token's ids (vocabulary-parallel embedding) and targets (the
    // loss runs on every token): one all_gather of both, packed [B, S/T, 2] -> [B, S, 2].
    const int64_t Sl = model.local_seq();
    Tensor packed = Tensor::empty({batch_, Sl, 2}, DType::kI32, MemCategory::kActivations);
    Tensor full = Tensor::empty({batch_, seq_, 2}, DType::kI32, MemCategory::kActivations);
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
    for (int64_t i = 0; i < 2 * c_.num_hidden_layers + 1; ++i)
      norm_partials_.push_back(Tensor::zeros({dims_.h}, DType::kF32, MemCategory::kGradients));
  } else {
    ids_ = local.input_ids.reshape({all_rows_});
    targets_ = local.target_ids.reshape({all_rows_});
  }
  positions_ = Tensor::empty({seq_}, DType::kI32, MemCategory::kActivations);
  std::iota(positions_.data<int32_t>(), positions_.data<int32_t>() + seq_, 0);
  rope_ = build_rope_table({positions_.data<int32_t>(), static_cast<size_t>(seq_)}, dims_.d, c_.rope_theta,
                           DType::kF32);
}

TpComm::Pending TpStep::start_gather_rows(const Tensor& local, Tensor& full) {
  const int64_t Sl = model_.local_seq(), h = dims_.h;
  Tensor f = full.reshape({batch_, seq_, h});
  return tp_.start_all_gather_seq(local.reshape({batch_, Sl, h}), f);
}

Tensor TpStep::gather_rows(const Tensor& local) {
  if (!sp_) return local;  // f: identity
  Tensor full = comm_buffer({all_rows_, dims_.h});
  TpComm::Pending p = start_gather_rows(local, full);
  tp_.wait(p);
  return full;
}

TpComm::Pending TpStep::start_reduce_rows(Tensor& partial, Tensor& out) {
  if (!sp_) {
    out = partial;
    return tp_.start_all_reduce(partial);  // g: all_reduce in place
  }
  const int64_t Sl = model_.local_seq(), h = dims_.h;
  out = act({rows_, dims_.h});
  Tensor o = out.reshape({batch_, Sl, h});
  return tp_.start_reduce_scatter_seq(partial.reshape({batch_, seq_, h}), o);
}

Tensor TpStep::reduce_rows(Tensor& partial) {
  Tensor out;
  TpComm::Pending p = start_reduce_rows(partial, out);
  tp_.wait(p);
  return out;
}

Tensor& TpStep::norm_grad(Tensor& grad, int index) { return sp_ ? norm_partials_[index] : grad; }

void TpStep::sum_norm_partials(ShardedWeights& grads) {
  if (!sp_) return;
  // One all_reduce of every gain's partial, packed: [(2L+1) * h].
  const int64_t L = c_.num_hidden_layers, n = static_cast<int64_t>(norm_partials_.size());
  Tensor packed = comm_buffer({n, dims_.h});
  for (int64_t i = 0; i < n; ++i) {
    Tensor row = packed.narrow(i, i + 1);
    be_.copy(norm_partials_[i], row);
  }
  tp_.all_reduce(packed);
  for (int64_t i = 0; i < n; ++i) {
    Tensor& dst = i < L ? grads.attn_norm[i] : (i < 2 * L ? grads.mlp_norm[i - L] : grads.final_norm);
    be_.add_inplace(packed.narrow(i, i + 1), dst);
  }
}

}  // namespace foldpar::tp_detail
