// TpStepBase: construction, the row mappings over tp, the vocabulary-parallel embedding,
// head and loss, and this strategy's parts of the model's step order (model/step_order.h).
//   embedding  fwd: local vocabulary rows, then g (all_reduce) or g' (reduce_scatter to this
//              rank's rows); bwd: dX of every row (g^T: identity, or all_gather) scattered
//              into this rank's vocabulary rows, no other communication.
//   head       fwd: xf = norm(x) on this rank's rows, f' (all_gather) with sequence
//              parallelism; the vocabulary-parallel cross-entropy on every row; bwd: the
//              partial d_xf through f^T (all_reduce, or reduce_scatter) while the LM head's
//              weight gradient computes.
#include "parallel/megatron/tp_step_base.h"

namespace foldpar::megatron_detail {

TpStepBase::TpStepBase(const LlamaConfig& config, const ShardDims& dims, Backend& backend, Communicator& tp,
                       int tp_rank, bool overlap, bool sequence_parallel, DType dtype, TpRows rows,
                       const Batch& local, TpStepInputs in)
    : c_(config),
      dims_(dims),
      be_(backend),
      tp_(tp, backend, overlap),
      seq_par_(sequence_parallel),
      dtype_(dtype),
      batch_(rows.batch),
      tp_seq_(rows.tp_seq),
      local_seq_(rows.local_seq),
      rows_(rows.batch * rows.local_seq),
      all_rows_(rows.batch * rows.tp_seq),
      ctx_{&config, &backend, rows.batch, rows.tp_seq, nullptr, nullptr},
      row_ctx_{&config, &backend, rows.batch, rows.local_seq, nullptr, nullptr},
      w_(*in.weights),
      in_(in),
      moe_stats_(config.moe.num_experts, config.moe.sparse_layer_count(config.num_hidden_layers)),
      saved_(in.grads != nullptr ? static_cast<size_t>(config.num_hidden_layers) : 0) {
  FP_CHECK(tp.size() == dims_.degree && tp.rank() == tp_rank, "tp rank {} of {} on communicator {}", tp_rank,
           dims_.degree, tp.describe());
  if (in.grads != nullptr) variant_partials_ = allocate_variant_partials(backend, config, dims, /*with_o_bias=*/false);
  if (seq_par_) {
    // Every tp rank needs every row's ids (vocabulary-parallel embedding) and targets (the
    // loss runs on every row): one all_gather of both, packed [B, local, 2] -> [B, tp_seq, 2].
    Tensor packed = Tensor::empty({batch_, local_seq_, 2}, DType::kI32, MemCategory::kActivations);
    Tensor full = Tensor::empty({batch_, tp_seq_, 2}, DType::kI32, MemCategory::kActivations);
    // Interleaved: ids at the even elements, targets at the odd ones.
    be_.copy_strided(local.input_ids, packed, {rows_, 1, {0, 1}, {0, 2}});
    be_.copy_strided(local.target_ids, packed, {rows_, 1, {0, 1}, {1, 2}});
    tp_.all_gather_seq(packed, full);
    ids_ = Tensor::empty({all_rows_}, DType::kI32, MemCategory::kActivations);
    targets_ = Tensor::empty({all_rows_}, DType::kI32, MemCategory::kActivations);
    be_.copy_strided(full, ids_, {all_rows_, 1, {0, 2}, {0, 1}});
    be_.copy_strided(full, targets_, {all_rows_, 1, {1, 2}, {0, 1}});
  } else {
    ids_ = local.input_ids.reshape({all_rows_});
    targets_ = local.target_ids.reshape({all_rows_});
  }
}

// ---- the row mappings ----

TpComm::Pending TpStepBase::start_gather_rows(const Tensor& local, Tensor& full) {
  const int64_t h = dims_.h;
  Tensor f = full.reshape({batch_, tp_seq_, h});
  return tp_.start_all_gather_seq(local.reshape({batch_, local_seq_, h}), f);
}

Tensor TpStepBase::gather_rows(const Tensor& local) {
  if (!seq_par_) return local;  // f: identity
  Tensor full = comm_buffer({all_rows_, dims_.h});
  TpComm::Pending p = start_gather_rows(local, full);
  tp_.wait(p);
  return full;
}

TpComm::Pending TpStepBase::start_reduce_rows(Tensor& partial, Tensor& out) {
  if (!seq_par_) {
    out = partial;
    if (tp_.size() == 1) return TpComm::Pending{};  // one rank's partial is the sum
    return tp_.start_all_reduce(partial);          // g: all_reduce in place
  }
  const int64_t h = dims_.h;
  out = act({rows_, h});
  Tensor o = out.reshape({batch_, local_seq_, h});
  return tp_.start_reduce_scatter_seq(partial.reshape({batch_, tp_seq_, h}), o);
}

Tensor TpStepBase::reduce_rows(Tensor& partial) {
  Tensor out;
  TpComm::Pending p = start_reduce_rows(partial, out);
  tp_.wait(p);
  return out;
}

Tensor& TpStepBase::norm_grad(Tensor& grad, int /*index*/) { return grad; }

void TpStepBase::set_positions(const Tensor* positions, const Tensor* rope_table) {
  ctx_.positions = positions;
  ctx_.rope_table = rope_table;
}

QkvWeights TpStepBase::qkv_view(const Tensor& packed_attn) const {
  const AttnPieces a = attn_pieces(dims_, packed_attn);
  return QkvWeights{a.wq, a.wk, a.wv};
}

QkvWeights TpStepBase::qkv_view(const ShardedWeights& w, int layer) const {
  QkvWeights q = qkv_view(w.attn[static_cast<size_t>(layer)]);
  const int r = tp_.rank();
  attach_attn_variants(w, layer, r * dims_.heads, dims_.heads, dims_.kv_head0(r), dims_.kv_heads, q);
  return q;
}

void TpStepBase::sum_variant_grads(ShardedWeights& grads) {
  sum_variant_partials(be_, variant_partials_, grads, [this](Tensor& packed) {
    if (tp_.size() > 1) tp_.all_reduce(packed);
  });
}

LinearView TpStepBase::wo_view(const Tensor& packed_attn) const {
  return LinearView{attn_pieces(dims_, packed_attn).wo_t, true};
}

MlpWeights TpStepBase::mlp_view(const Tensor& packed_mlp) const {
  const MlpPieces m = mlp_pieces(dims_, packed_mlp);
  return MlpWeights{m.w_gate, m.w_up, LinearView{m.w_down_t, true}};
}

MlpWeights TpStepBase::mlp_biased_view(int l) const {
  MlpWeights m = mlp_view(w_.mlp[l]);
  attach_mlp_bias(w_, l, tp_.rank() * dims_.f_rows, dims_.f_rows, m);
  if (tp_.rank() == 0 && static_cast<size_t>(l) < w_.down_bias.size()) m.down.b = w_.down_bias[l];
  return m;
}

// ---- embedding, head and loss ----

Tensor TpStepBase::embed_forward() {
  Tensor partial = row_partial();
  embedding_partial(be_, tp_.rank(), ids_, w_.embed, partial);
  return reduce_rows(partial);  // fwd: g or g'
}

void TpStepBase::embed_backward(const Tensor& dx) {
  const Tensor dx_full = gather_rows(dx);  // bwd of g: identity; of g': all_gather
  be_.embedding_backward(ids_, dx_full, tp_.rank() * dims_.v_rows, in_.grads->embed);
}

StepResult TpStepBase::head_forward(const Tensor& x, bool /*save: the head always keeps its state*/) {
  hs_.norm = norm_forward(row_ctx_, w_.final_norm, x);  // xf [R, h]
  // Kept for the head's weight gradient (one [N, h]; the local logits kept beside it are
  // [N, V/tp]), rather than gathered again in backward; xf itself goes at the end.
  hs_.xf_full = gather_rows(hs_.norm.a);  // fwd: f or f'
  hs_.loss = vocab_parallel_cross_entropy(tp_, hs_.xf_full, w_.lm_head, targets_);
  StepResult r;
  if (in_.keep_logits) {  // verification only: this rank's rows, every column
    std::vector<int64_t> rows;
    const int64_t first = seq_par_ ? tp_.rank() * local_seq_ : 0;
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t i = 0; i < local_seq_; ++i) rows.push_back(b * tp_seq_ + first + i);
    r.logits = gather_vocab_logits(tp_, hs_.loss.logits, rows).reshape({batch_, local_seq_, c_.vocab_size});
  }
  r.loss_sum = hs_.loss.loss_sum;
  r.valid_tokens = hs_.loss.valid_tokens;
  r.loss = r.valid_tokens > 0 ? r.loss_sum / static_cast<double>(r.valid_tokens) : 0.0;
  if (seq_par_) hs_.norm.a = Tensor();  // xf_full is kept
  return r;
}

Tensor TpStepBase::head_backward(const StepResult& result) {
  const int64_t normalizer = in_.loss_normalizer > 0 ? in_.loss_normalizer : result.valid_tokens;
  const double scale = normalizer > 0 ? 1.0 / static_cast<double>(normalizer) : 0.0;
  ShardedWeights& g = *in_.grads;
  Tensor d_xf_partial = row_partial();
  vocab_parallel_cross_entropy_backward(be_, tp_.rank(), hs_.loss, w_.lm_head, targets_, scale, d_xf_partial);
  Tensor d_xf;
  TpComm::Pending req = start_reduce_rows(d_xf_partial, d_xf);  // bwd of f: all_reduce; of f': reduce_scatter
  vocab_parallel_head_weight_grad(be_, hs_.loss, hs_.xf_full, g.lm_head);
  tp_.wait(req);
  hs_.loss = VocabParallelLoss();
  hs_.xf_full = Tensor();
  hs_.norm.a = Tensor();
  Tensor dx = norm_backward(row_ctx_, w_.final_norm, hs_.norm, d_xf, nullptr,
                            norm_grad(g.final_norm, 2 * static_cast<int>(c_.num_hidden_layers)));
  hs_ = HeadSaved();
  return dx;
}

// ---- the blocks, for the model's step order ----

Tensor TpStepBase::block_forward(int64_t layer, const Tensor& x, bool save) {
  LayerSaved* s = save ? &saved_[static_cast<size_t>(layer)] : nullptr;
  const bool keep_gathered = save && in_.recompute;
  const int l = static_cast<int>(layer);
  Tensor x_mid = attention_forward(l, x, s != nullptr ? &s->attn : nullptr, keep_gathered);
  if (l < static_cast<int>(w_.moe.size()) && w_.moe[l].defined())
    return moe_replicated_ ? moe_forward_replicated(l, x_mid) : moe_forward(l, x_mid, s != nullptr ? &s->mlp : nullptr);
  return mlp_forward(l, x_mid, s != nullptr ? &s->mlp : nullptr, keep_gathered);
}

Tensor TpStepBase::block_backward(int64_t layer, Tensor dx) {
  LayerSaved& s = saved_[static_cast<size_t>(layer)];
  const int l = static_cast<int>(layer);
  dx = l < static_cast<int>(w_.moe.size()) && w_.moe[l].defined() ? moe_backward(l, s.mlp, dx)
                                                                    : mlp_backward(l, s.mlp, dx);  // frees d(x_out)
  dx = attention_backward(l, s.attn, dx);
  s = LayerSaved();
  return dx;
}

bool TpStepBase::defer_weight_grads(WeightGradQueue* queue) {
  if (queue != nullptr && c_.moe.enabled()) return false;
  ctx_.weight_grads = queue;  // ctx_ is this micro-batch's; the head's and norms' contexts are not
  return true;
}

}  // namespace foldpar::megatron_detail
