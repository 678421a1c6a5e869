// Scheme A over one expert axis (parallel/moe_dispatch.h); moved out of TSP's tsp_moe.cc so
// that the Megatron baselines' expert parallelism runs the same dispatch.
#include "parallel/moe_dispatch.h"

#include <chrono>

namespace foldpar {

const char* moe_dispatch_name(MoeDispatch d) {
  switch (d) {
    case MoeDispatch::kAllToAll: return "a2a";
    case MoeDispatch::kGather: return "gather";
    case MoeDispatch::kRing: return "ring";
  }
  return "?";
}

void MoeAllToAll::forward(const BlockContext& ctx, const MoeLayerWeights& mw, const Tensor& a, MoeSaved& r,
                          const std::vector<int32_t>& token_rows, MoeShardSaved& s, bool save) {
  const int64_t h = dims_.h, M = static_cast<int64_t>(token_rows.size()), El = dims_.experts;
  // ---- counts: this rank's counts of rank q's El experts go to q ----
  const size_t n = static_cast<size_t>(D_ * El);
  std::vector<int64_t> send_counts(n), recv_counts(n);
  s.send_at.assign(static_cast<size_t>(D_), 0);
  s.send_rows.assign(static_cast<size_t>(D_), 0);
  s.recv_rows.assign(static_cast<size_t>(D_), 0);
  for (int q = 0; q < D_; ++q) {
    const int64_t e0 = dims_.expert0(q);
    s.send_at[q] = r.offsets[e0];  // split experts: the D/E ranks of one expert get the same rows
    for (int64_t j = 0; j < El; ++j) send_counts[q * El + j] = r.offsets[e0 + j + 1] - r.offsets[e0 + j];
  }
  const auto t0 = std::chrono::steady_clock::now();
  Tensor send_buf = moe_comm_from_host(be_, send_counts, DType::kI64), recv_buf = moe_comm_from_host(be_, recv_counts, DType::kI64);
  timer_.blocking(comm_.all_to_all(send_buf.raw_data(), recv_buf.raw_data(), static_cast<size_t>(El), DType::kI64), t0);
  moe_comm_to_host(be_, recv_buf, recv_counts);
  for (int q = 0; q < D_; ++q)
    for (int64_t j = 0; j < El; ++j) {
      s.send_rows[q] += send_counts[q * El + j];
      s.recv_rows[q] += recv_counts[q * El + j];
    }
  if (dims_.expert_group > 1) {
    // Each dispatched row comes back once from every rank of its expert's group, a partial
    // output over that rank's f_e slice: where each returned row adds in (dispatch order)
    // and the token it belongs to (the backward's d(rows) go there).
    std::vector<int32_t> combine_rows, combine_tokens;
    for (int q = 0; q < D_; ++q)
      for (int64_t i = 0; i < s.send_rows[q]; ++i) {
        combine_rows.push_back(static_cast<int32_t>(s.send_at[q] + i));
        combine_tokens.push_back(token_rows[static_cast<size_t>(s.send_at[q] + i)]);
      }
    s.combine_rows = moe_upload_i32(be_, combine_rows);
    s.combine_tokens = moe_upload_i32(be_, combine_tokens);
  }
  // ---- the received rows, source-major, into expert-major groups ----
  std::vector<int64_t> source_at(static_cast<size_t>(D_) + 1, 0);
  for (int q = 0; q < D_; ++q) source_at[q + 1] = source_at[q] + s.recv_rows[q];
  const int64_t R = source_at[D_];
  std::vector<int32_t> to_expert, to_source(static_cast<size_t>(R));
  s.expert_offsets.assign(static_cast<size_t>(El) + 1, 0);
  for (int64_t j = 0; j < El; ++j) {
    for (int q = 0; q < D_; ++q) {
      int64_t first = source_at[q];
      for (int64_t i = 0; i < j; ++i) first += recv_counts[q * El + i];
      for (int64_t i = 0; i < recv_counts[q * El + j]; ++i) {
        to_source[static_cast<size_t>(first + i)] = static_cast<int32_t>(to_expert.size());
        to_expert.push_back(static_cast<int32_t>(first + i));
      }
    }
    s.expert_offsets[j + 1] = static_cast<int64_t>(to_expert.size());
  }
  s.to_expert = moe_upload_i32(be_, to_expert);
  s.to_source = moe_upload_i32(be_, to_source);
  Tensor dispatched = act({M, h});
  be_.gather_rows(a, r.token_rows, nullptr, dispatched);
  Tensor received = exchange_rows(dispatched, s.send_at, s.send_rows, s.recv_rows);
  dispatched = Tensor();
  s.expert_in = act({R, h});
  if (R > 0) be_.gather_rows(received, s.to_expert, nullptr, s.expert_in);
  received = Tensor();
  Tensor expert_out = act({R, h});
  s.expert_mlp.resize(static_cast<size_t>(El));
  for (int64_t j = 0; j < El; ++j) {
    const int64_t begin = s.expert_offsets[j], end = s.expert_offsets[j + 1];
    if (begin == end) continue;
    Tensor out = expert_out.narrow(begin, end);
    foldpar::mlp_forward(moe_group_context(ctx, end - begin), expert_mlp_weights(mw.experts[j]), s.expert_in.narrow(begin, end),
                         out, save ? &s.expert_mlp[j] : nullptr, {}, 0.0f);
  }
  Tensor back = act({R, h});
  if (R > 0) be_.gather_rows(expert_out, s.to_source, nullptr, back);
  expert_out = Tensor();
  Tensor returned = exchange_rows(back, s.recv_rows, s.send_rows);  // per rank q, its outputs of q's rows
  if (dims_.expert_group == 1) {
    r.expert_out = std::move(returned);  // [M, h] in dispatch order
  } else {
    r.expert_out = act({M, h});  // the sum of the D/E partial outputs of each row
    be_.fill(0.0, r.expert_out);
    if (returned.dim(0) > 0) be_.scatter_add_rows(returned, s.combine_rows, nullptr, r.expert_out);
  }
}

void MoeAllToAll::backward(const BlockContext& ctx, const MoeLayerWeights& mw, const MoeShardSaved& s,
                           const MoeSaved& r, const Tensor& d_out, Tensor& d_a, MoeLayerWeights& gw) {
  const int64_t h = dims_.h, El = dims_.experts;
  auto experts_backward = [&](const Tensor& d_o, Tensor& d_in) {
    for (int64_t j = 0; j < El; ++j) {
      const int64_t begin = s.expert_offsets[j], end = s.expert_offsets[j + 1];
      if (begin == end) continue;
      Tensor d_rows = d_in.narrow(begin, end);
      MlpWeights ge = expert_mlp_weights(gw.experts[j]);  // the owner's gradient: no sum needed
      foldpar::mlp_backward(moe_group_context(ctx, end - begin), expert_mlp_weights(mw.experts[j]), s.expert_mlp[j],
                            s.expert_in.narrow(begin, end), d_o.narrow(begin, end), d_rows, ge, 1.0f);
    }
  };
  Tensor d_received = exchange_rows(d_out, s.send_at, s.send_rows, s.recv_rows);
  const int64_t R = d_received.dim(0);
  Tensor d_expert_out = act({R, h}), d_expert_in = act({R, h});
  if (R > 0) be_.gather_rows(d_received, s.to_expert, nullptr, d_expert_out);
  be_.fill(0.0, d_expert_in);
  experts_backward(d_expert_out, d_expert_in);
  Tensor d_back = act({R, h});
  if (R > 0) be_.gather_rows(d_expert_in, s.to_source, nullptr, d_back);
  // [M, h] in dispatch order; split experts: D/E partial d(rows) of each row, summed per token.
  Tensor d_dispatched = exchange_rows(d_back, s.recv_rows, s.send_rows);
  if (d_dispatched.dim(0) > 0)
    be_.scatter_add_rows(d_dispatched, dims_.expert_group == 1 ? r.token_rows : s.combine_tokens, nullptr, d_a);
}

Tensor MoeAllToAll::exchange_rows(const Tensor& src, const std::vector<int64_t>& send_rows,
                                  const std::vector<int64_t>& recv_rows) {
  std::vector<int64_t> send_at(static_cast<size_t>(D_) + 1, 0);
  for (int r = 0; r < D_; ++r) send_at[r + 1] = send_at[r] + send_rows[r];
  FP_CHECK(send_at[D_] == src.dim(0), "exchange of {} rows from {}", send_at[D_], src.describe());
  return exchange_rows(src, send_at, send_rows, recv_rows);
}

Tensor MoeAllToAll::exchange_rows(const Tensor& src, const std::vector<int64_t>& send_at,
                              const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows) {
  const int64_t h = src.dim(1);
  int64_t total = 0;
  for (int64_t n : recv_rows) total += n;
  Tensor dst = Tensor::empty({total, h}, src.dtype(), MemCategory::kComm);
  std::vector<int64_t> recv_at(static_cast<size_t>(D_) + 1, 0);
  for (int r = 0; r < D_; ++r) {
    recv_at[r + 1] = recv_at[r] + recv_rows[r];
    FP_CHECK(send_at[r] >= 0 && send_at[r] + send_rows[r] <= src.dim(0), "rows {}+{} for rank {} from {}", send_at[r],
             send_rows[r], r, src.describe());
  }
  std::vector<CommRequest> requests;
  for (int r = 0; r < D_; ++r) {
    if (r == p_ || recv_rows[r] == 0) continue;
    Tensor block = dst.narrow(recv_at[r], recv_at[r + 1]);
    requests.push_back(comm_.irecv(block.raw_data(), static_cast<size_t>(block.numel()), dst.dtype(), r));
  }
  for (int r = 0; r < D_; ++r) {
    if (r == p_ || send_rows[r] == 0) continue;
    Tensor block = src.narrow(send_at[r], send_at[r] + send_rows[r]);
    requests.push_back(comm_.isend(block.raw_data(), static_cast<size_t>(block.numel()), src.dtype(), r));
  }
  if (send_rows[p_] > 0) {
    Tensor own = dst.narrow(recv_at[p_], recv_at[p_ + 1]);
    be_.copy(src.narrow(send_at[p_], send_at[p_] + send_rows[p_]), own);
  }
  timer_.wait_all(requests);
  return dst;
}

}  // namespace foldpar
