// Tensor parallelism's collectives (the conjugate mappings) and the vocabulary-parallel
// embedding and cross-entropy.
#include "parallel/tensor_parallel.h"

#include <algorithm>
#include <cmath>

#include "model/llama_model.h"

namespace foldpar {
namespace {

// The sequence collectives move one contiguous buffer, which holds the rows rank by rank
// ([T, B, n, ...], rank-major), while the model's tensors are batch-major ([B, T*n, ...]).
// Both are B*T blocks of n rows; this copies block (b, r) between the two orders. With B = 1
// the orders coincide and nothing is copied (callers skip it).
void reorder_blocks(Backend& be, const Tensor& src, Tensor& dst, int64_t B, int T, bool to_rank_major) {
  const int64_t blocks = B * T, block = src.numel() / blocks;
  const Tensor s = src.reshape({blocks, block});
  Tensor d = dst.reshape({blocks, block});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < T; ++r) {
      const int64_t batch_major = b * T + r, rank_major = r * B + b;
      const int64_t from = to_rank_major ? batch_major : rank_major, to = to_rank_major ? rank_major : batch_major;
      Tensor dst_block = d.narrow(to, to + 1);
      be.copy(s.narrow(from, from + 1), dst_block);
    }
}

void check_seq_shapes(const Tensor& local, const Tensor& full, int T, const char* what) {
  FP_CHECK(local.rank() >= 2 && full.rank() == local.rank() && full.dim(0) == local.dim(0) &&
               full.dim(1) == local.dim(1) * T && full.numel() == local.numel() * T && full.dtype() == local.dtype(),
           "{}: local {} and full {} over {} ranks", what, local.describe(), full.describe(), T);
}

}  // namespace

TpComm::TpComm(Communicator& tp, Backend& backend, bool overlap) : comm_(tp), be_(backend), overlap_(overlap) {}

void TpComm::wait(Pending& p) {
  timer_.wait(p.request);
  if (p.reorder_to.defined())
    reorder_blocks(be_, p.staging, p.reorder_to, p.reorder_to.dim(0), size(), /*to_rank_major=*/false);
  p.staging = Tensor();
  p.reorder_to = Tensor();
}

void TpComm::progress(Pending& p) { StepTimer::poke(p.request); }

TpComm::Pending TpComm::start_all_reduce(Tensor& x) {
  Pending p;
  p.request = comm_.iall_reduce(x.raw_data(), x.raw_data(), static_cast<size_t>(x.numel()), x.dtype(), ReduceOp::kSum);
  if (!overlap_) wait(p);
  return p;
}

void TpComm::all_reduce(Tensor& x) {
  Pending p = start_all_reduce(x);
  wait(p);
}

TpComm::Pending TpComm::start_all_gather_seq(const Tensor& local, Tensor& full) {
  check_seq_shapes(local, full, size(), "all_gather_seq");
  const int64_t B = local.dim(0);
  Pending p;
  Tensor dst = full;
  if (B > 1 && size() > 1) {
    p.staging = Tensor::empty({full.numel()}, full.dtype(), MemCategory::kComm);
    p.reorder_to = full;
    dst = p.staging;
  }
  p.request = comm_.iall_gather(local.raw_data(), dst.raw_data(), static_cast<size_t>(local.numel()), local.dtype());
  if (!overlap_) wait(p);
  return p;
}

void TpComm::all_gather_seq(const Tensor& local, Tensor& full) {
  Pending p = start_all_gather_seq(local, full);
  wait(p);
}

TpComm::Pending TpComm::start_reduce_scatter_seq(const Tensor& full, Tensor& local) {
  check_seq_shapes(local, full, size(), "reduce_scatter_seq");
  const int64_t B = local.dim(0);
  Pending p;
  Tensor src = full;
  if (B > 1 && size() > 1) {
    // The staging buffer is the send buffer: it must live until the request completes.
    p.staging = Tensor::empty({full.numel()}, full.dtype(), MemCategory::kComm);
    reorder_blocks(be_, full, p.staging, B, size(), /*to_rank_major=*/true);
    src = p.staging;
  }
  p.request = comm_.ireduce_scatter(src.raw_data(), local.raw_data(), static_cast<size_t>(local.numel()),
                                    local.dtype(), ReduceOp::kSum);
  // Nothing to reorder after the wait: the result lands in `local` directly.
  if (!overlap_) wait(p);
  return p;
}

void TpComm::reduce_scatter_seq(const Tensor& full, Tensor& local) {
  Pending p = start_reduce_scatter_seq(full, local);
  wait(p);
}

// ---- vocabulary-parallel embedding and cross-entropy ----

void embedding_partial(Backend& be, int tp_rank, const Tensor& ids, const Tensor& table, Tensor& out) {
  be.fill(0.0, out);
  be.embedding_forward(ids, table, tp_rank * table.dim(0), out);
}

VocabParallelLoss vocab_parallel_cross_entropy(TpComm& tp, const Tensor& xf, const Tensor& head,
                                               const Tensor& targets) {
  Backend& be = tp.backend();
  const int64_t n = xf.numel() / xf.dim(-1), vr = head.dim(0);
  // The logits in the activations' dtype (bf16 storage: as the single-rank model's head);
  // the row maxima, sums and lse are statistics, always f32.
  auto act = [](const Shape& s) { return Tensor::empty(s, DType::kF32, MemCategory::kActivations); };
  VocabParallelLoss out;
  out.logits = Tensor::empty({n, vr}, xf.dtype(), MemCategory::kActivations);
  be.matmul(xf, false, head, true, out.logits);
  // This rank's columns: its row maxima, sums of exponentials and target logits.
  Tensor local_max = act({n}), global_max = act({n}), sums = act({2, n});
  Tensor row_sum = sums.narrow(0, 1).reshape({n}), target_logit = sums.narrow(1, 2).reshape({n});
  be.fill(-INFINITY, local_max);
  be.fill(0.0, sums);
  be.softmax_chunk_update(out.logits, targets, tp.rank() * vr, kIgnoreIndex, local_max, row_sum, target_logit);
  // One rank holds the whole vocabulary: its sums are the answer (no collective on a
  // communicator of one).
  const bool reduce = tp.size() > 1;
  auto t0 = StepTimer::Clock::now();
  if (reduce)
    tp.blocking(tp.comm().all_reduce(local_max.raw_data(), global_max.raw_data(), static_cast<size_t>(n),
                                     DType::kF32, ReduceOp::kMax),
                t0);
  else
    be.copy(local_max, global_max);
  // Rescale to the global maximum, then one sum for both the exponentials and the targets.
  be.softmax_rescale(local_max, global_max, row_sum);
  t0 = StepTimer::Clock::now();
  if (reduce)
    tp.blocking(tp.comm().all_reduce(sums.raw_data(), sums.raw_data(), static_cast<size_t>(2 * n), DType::kF32,
                                     ReduceOp::kSum),
                t0);
  out.lse = act({n});
  const LossSums loss = be.cross_entropy_finish(global_max, row_sum, target_logit, targets, kIgnoreIndex, out.lse);
  out.loss_sum = loss.loss_sum;
  out.valid_tokens = loss.valid_tokens;
  return out;
}

void vocab_parallel_cross_entropy_backward(Backend& be, int tp_rank, VocabParallelLoss& loss, const Tensor& head,
                                           const Tensor& targets, double grad_scale, Tensor& d_xf) {
  // d_logits = (softmax - onehot) * scale on this rank's columns, in place.
  be.cross_entropy_backward(loss.logits, targets, loss.lse, tp_rank * head.dim(0), kIgnoreIndex, grad_scale,
                            loss.logits);
  be.matmul(loss.logits, false, head, false, d_xf);  // d_xf = d_logits head (partial over tp)
}

void vocab_parallel_head_weight_grad(Backend& be, const VocabParallelLoss& loss, const Tensor& xf, Tensor& d_head) {
  be.matmul(loss.logits, true, xf, false, d_head, 1.0f, 1.0f);  // d_head += d_logits^T xf
}

Tensor gather_vocab_logits(TpComm& tp, const Tensor& local, std::span<const int64_t> rows) {
  const int T = tp.size();
  const int64_t n = local.dim(0), vr = local.dim(1), V = vr * T, count = static_cast<int64_t>(rows.size());
  // One rank: its columns are every column (no collective on a communicator of one). bf16
  // logits travel as bf16 and are widened once, here.
  Tensor all = local;
  if (T > 1) {
    all = Tensor::empty({T, n, vr}, local.dtype(), MemCategory::kComm);
    const auto t0 = StepTimer::Clock::now();
    tp.blocking(tp.comm().all_gather(local.raw_data(), all.raw_data(), static_cast<size_t>(n * vr), local.dtype()),
                t0);
  }
  if (all.dtype() != DType::kF32) {
    Tensor wide = Tensor::empty(all.shape(), DType::kF32, MemCategory::kWorkspace);
    tp.backend().copy(all, wide);
    all = wide;
  }
  Tensor out = Tensor::empty({count, V}, DType::kF32, MemCategory::kActivations);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t r = 0; r < T; ++r)
      tp.backend().copy_strided(all, out, {1, vr, {(r * n + rows[i]) * vr, vr}, {i * V + r * vr, V}});
  return out;
}

}  // namespace foldpar
