// SpStep: construction, the token-wise parts of an SP step (embedding, MLP, head and loss:
// the single-rank math of model/llama_block.cc and llama_model.cc on the local tokens, no
// communication) and the communication helpers.
#include "parallel/sp/sp_step.h"

#include <algorithm>

#include "backend/rope_table.h"

namespace foldpar::sp_detail {

SpStep::SpStep(const SpModel& model, Backend& backend, Communicator& comm, int64_t batch)
    : c_(model.config()),
      opt_(model.options()),
      be_(backend),
      comm_(comm),
      batch_(batch),
      local_seq_(model.shard().local_seq()),
      rows_(batch * model.shard().local_seq()),
      seq_(model.shard().seq()) {
  FP_CHECK(comm.size() == model.shard().degree() && comm.rank() == model.shard().rank(),
           "SP model for rank {} of {} on communicator {}", model.shard().rank(), model.shard().degree(),
           comm.describe());
  const std::vector<int32_t>& local = model.shard().positions();
  const std::vector<int32_t> all = model.shard().gathered_positions();
  q_pos_ = Tensor::empty({local_seq_}, DType::kI32, MemCategory::kActivations);
  k_pos_ = Tensor::empty({seq_}, DType::kI32, MemCategory::kActivations);
  std::copy(local.begin(), local.end(), q_pos_.data<int32_t>());
  std::copy(all.begin(), all.end(), k_pos_.data<int32_t>());
  rope_ = build_rope_table(local, c_.head_dim(), c_.rope_theta, DType::kF32);
}

// ---- communication helpers ----

void SpStep::wait_all(std::vector<CommRequest>& requests) {
  const auto t0 = std::chrono::steady_clock::now();
  for (CommRequest& r : requests) FP_CHECK_OK(r.wait());
  requests.clear();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void SpStep::poke(std::vector<CommRequest>& requests) {
  for (CommRequest& r : requests) {
    bool done = false;
    FP_CHECK_OK(r.test(&done));
  }
}

void SpStep::blocking(const Status& status, std::chrono::steady_clock::time_point t0) {
  FP_CHECK_OK(status);
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void SpStep::all_reduce_grads(Tensor& flat) {
  // MPI counts are int: a 7B model's gradient needs several messages.
  constexpr int64_t kMaxElements = int64_t{1} << 30;
  const int64_t n = flat.numel();
  for (int64_t begin = 0; begin < n; begin += kMaxElements) {
    Tensor chunk = flat.narrow(begin, std::min(n, begin + kMaxElements));
    const auto t0 = std::chrono::steady_clock::now();
    blocking(comm_.all_reduce(chunk.raw_data(), chunk.raw_data(), static_cast<size_t>(chunk.numel()), DType::kF32,
                              ReduceOp::kSum),
             t0);
  }
}

// ---- the block: attention (sp_attention.cc), then the local MLP ----

Tensor SpStep::block_forward(const LayerWeights& w, const Tensor& x_in, LayerSaved* saved, bool keep_gathered) {
  const int64_t T = rows_, h = c_.hidden_size, f = c_.intermediate_size;
  LayerSaved local;
  LayerSaved& s = saved != nullptr ? *saved : local;
  s.x_in = x_in;
  Tensor x_mid = attention_forward(w, x_in, s, keep_gathered);

  // x_out = x_mid + (silu(a2 Wg^T) * (a2 Wu^T)) Wd^T, a2 = norm(x_mid)
  s.x_mid = x_mid;
  s.rstd_mlp = act({T});
  s.a2 = act({T, h});
  be_.rmsnorm_forward(x_mid, w.mlp_norm, c_.rms_norm_eps, s.a2, s.rstd_mlp);
  s.gate = act({T, f});
  s.up = act({T, f});
  be_.matmul(s.a2, false, w.w_gate, true, s.gate);
  be_.matmul(s.a2, false, w.w_up, true, s.up);
  s.act = act({T, f});
  be_.swiglu_forward(s.gate, s.up, s.act);
  Tensor x_out = act({T, h});
  be_.copy(x_mid, x_out);
  be_.matmul(s.act, false, w.w_down, true, x_out, 1.0f, 1.0f);
  return x_out;
}

Tensor SpStep::block_backward(const LayerWeights& w, LayerSaved& s, const Tensor& dx_out, LayerWeights& g) {
  const int64_t T = rows_, h = c_.hidden_size, f = c_.intermediate_size;
  // x_out = x_mid + act Wd^T
  Tensor d_act = act({T, f});
  be_.matmul(dx_out, false, w.w_down, false, d_act);
  be_.matmul(dx_out, true, s.act, false, g.w_down, 1.0f, 1.0f);
  Tensor d_gate = act({T, f}), d_up = act({T, f});
  be_.swiglu_backward(s.gate, s.up, d_act, d_gate, d_up);
  d_act = Tensor();
  // gate = a2 Wg^T, up = a2 Wu^T
  Tensor d_a2 = act({T, h});
  be_.matmul(d_gate, false, w.w_gate, false, d_a2);
  be_.matmul(d_up, false, w.w_up, false, d_a2, 1.0f, 1.0f);
  be_.matmul(d_gate, true, s.a2, false, g.w_gate, 1.0f, 1.0f);
  be_.matmul(d_up, true, s.a2, false, g.w_up, 1.0f, 1.0f);
  d_gate = Tensor();
  d_up = Tensor();
  // a2 = norm(x_mid); dx_mid = dx_out + norm^T(d_a2)
  Tensor dx_mid = act({T, h});
  be_.rmsnorm_backward(s.x_mid, w.mlp_norm, s.rstd_mlp, d_a2, dx_mid, g.mlp_norm);
  be_.add_inplace(dx_out, dx_mid);
  d_a2 = Tensor();
  return attention_backward(w, s, dx_mid, g);
}

// ---- embedding, head, loss ----

Tensor SpStep::embed(const LlamaWeights& w, const Tensor& ids) {
  Tensor x = act({rows_, c_.hidden_size});
  be_.embedding_forward(ids, w.embed, 0, x);
  return x;
}

void SpStep::embed_backward(const Tensor& ids, const Tensor& dx, LlamaWeights& g) {
  be_.embedding_backward(ids, dx, 0, g.embed);
}

StepResult SpStep::head_forward(const LlamaWeights& w, const Tensor& x, const Tensor& targets, HeadSaved& hs,
                                bool keep_logits) {
  const int64_t T = rows_, h = c_.hidden_size;
  hs.x_last = x;
  hs.rstd = act({T});
  hs.xf = act({T, h});
  be_.rmsnorm_forward(x, w.final_norm, c_.rms_norm_eps, hs.xf, hs.rstd);
  hs.logits = act({T, c_.vocab_size});
  be_.matmul(hs.xf, false, w.lm_head, true, hs.logits);
  hs.lse = act({T});
  // The local sum and count, then the sums over the axis: the mean is over the global batch.
  double sums[2] = {be_.cross_entropy_forward(hs.logits, targets, kIgnoreIndex, hs.lse),
                    static_cast<double>(count_valid_targets(targets, kIgnoreIndex))};
  const auto t0 = std::chrono::steady_clock::now();
  blocking(comm_.all_reduce(sums, sums, 2, DType::kF64, ReduceOp::kSum), t0);
  StepResult r;
  r.loss_sum = sums[0];
  r.valid_tokens = static_cast<int64_t>(sums[1]);
  r.loss = r.valid_tokens > 0 ? r.loss_sum / static_cast<double>(r.valid_tokens) : 0.0;
  if (keep_logits) r.logits = hs.logits.clone(MemCategory::kActivations);
  return r;
}

Tensor SpStep::head_backward(const LlamaWeights& w, HeadSaved& hs, const Tensor& targets, int64_t valid_tokens,
                             LlamaWeights& g) {
  const int64_t T = rows_, h = c_.hidden_size;
  const double scale = valid_tokens > 0 ? 1.0 / static_cast<double>(valid_tokens) : 0.0;
  be_.cross_entropy_backward(hs.logits, targets, hs.lse, 0, kIgnoreIndex, scale, hs.logits);
  Tensor d_xf = act({T, h});
  be_.matmul(hs.logits, false, w.lm_head, false, d_xf);                // d_xf = dlogits Whead
  be_.matmul(hs.logits, true, hs.xf, false, g.lm_head, 1.0f, 1.0f);  // dWhead += dlogits^T xf
  hs.logits = Tensor();
  Tensor dx = act({T, h});
  be_.rmsnorm_backward(hs.x_last, w.final_norm, hs.rstd, d_xf, dx, g.final_norm);
  return dx;
}

}  // namespace foldpar::sp_detail
