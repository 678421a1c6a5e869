// Megatron tensor parallelism's communication, shared by the strategies that shard weights
// over a tp axis (megatron/): the conjugate mappings over one tp communicator and
// the vocabulary-parallel embedding and cross-entropy. Everything here works on whatever
// token rows the caller gives it (every token in plain TP, a sequence shard under TP x SP),
// so the same calls serve both. Strategy state (weights, saved activations) does not live
// here. Notation: T the tp degree, t this rank, n token rows, V/T vocabulary rows per rank.
//
// The conjugate pairs of Megatron's core/tensor_parallel/mappings.py, as calls (there is no
// autograd: each strategy calls the adjoint itself in its backward):
//   f   before a column-parallel GEMM     fwd: identity          bwd: all_reduce
//   g   after a row-parallel GEMM         fwd: all_reduce        bwd: identity
//   f'  f with sequence-parallel norms    fwd: all_gather_seq    bwd: reduce_scatter_seq
//   g'  g with sequence-parallel norms    fwd: reduce_scatter_seq bwd: all_gather_seq
// so a strategy needs only all_reduce, all_gather_seq and reduce_scatter_seq below.
#pragma once

#include <cstdint>
#include <span>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "parallel/step_timer.h"
#include "tensor/tensor.h"

namespace foldpar {

// The collectives of tensor parallelism over one tp communicator, with the time this rank
// spends blocked in them. Every call is collective over tp (same order on every rank). All
// tensors are f32 unless stated.
class TpComm {
 public:
  // overlap: start_* returns at once and the caller calls progress() between pieces of work
  // (MPI moves transfers only inside MPI calls); false: start_* completes before returning,
  // to measure what overlap hides.
  TpComm(Communicator& tp, Backend& backend, bool overlap);

  Communicator& comm() const { return comm_; }
  Backend& backend() const { return be_; }
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }

  // A collective in flight: wait() before reading its output or touching its input.
  struct Pending {
    CommRequest request;
    Tensor staging;     // B > 1: the rank-major buffer the collective sends or receives
    Tensor reorder_to;  // all_gather_seq: where wait() puts the staging rows, [B, T*n, ...]
  };

  // x: any shape, summed over tp in place. g's forward; f's backward.
  void all_reduce(Tensor& x);
  Pending start_all_reduce(Tensor& x);
  // local: [B, n, ...] this rank's rows of every batch entry -> full: [B, T*n, ...] written,
  // rank r's rows at [r*n, (r+1)*n) of each entry (a contiguous split). One all_gather of
  // B*n*... elements; f32 or i32. f''s forward; g''s backward.
  void all_gather_seq(const Tensor& local, Tensor& full);
  Pending start_all_gather_seq(const Tensor& local, Tensor& full);
  // full: [B, T*n, ...] -> local: [B, n, ...] written with the tp sum of this rank's rows.
  // One reduce_scatter. g''s forward; f''s backward. `full` is only read.
  void reduce_scatter_seq(const Tensor& full, Tensor& local);
  Pending start_reduce_scatter_seq(const Tensor& full, Tensor& local);

  void wait(Pending& pending);
  void progress(Pending& pending);  // never blocks
  // Timed blocking collective for calls outside the mappings (the loss, norm gains).
  void blocking(const Status& status, StepTimer::Clock::time_point started) { timer_.blocking(status, started); }

  // The time this rank spent blocked in collectives and waits: the exposed communication.
  // A strategy with more axes counts its other waits here too.
  StepTimer& timer() { return timer_; }
  double blocked_seconds() const { return timer_.seconds(); }

 private:
  Communicator& comm_;
  Backend& be_;
  bool overlap_;
  StepTimer timer_;
};

// ---- vocabulary-parallel embedding ----
// This rank's part: out [n, h] written with the table row of every id in its vocabulary
// rows [t*V/T, (t+1)*V/T) and 0 for the other ids. The sum over tp is the embedding; reduce
// it with all_reduce (g) or reduce_scatter_seq (g'). ids: i32 [n]; table: [V/T, h]. The
// backward is Backend::embedding_backward with the same offset: each rank scatters into its
// own rows, no communication. Not collective.
void embedding_partial(Backend& backend, int tp_rank, const Tensor& ids, const Tensor& table, Tensor& out);

// ---- vocabulary-parallel cross-entropy (Megatron's vocab_parallel_cross_entropy) ----
struct VocabParallelLoss {
  Tensor logits;          // [n, V/T] this rank's columns in xf's dtype; kept for backward, which overwrites it
  Tensor lse;             // [n] log-sum-exp over the full vocabulary (f32)
  double loss_sum = 0;    // sum over the valid rows given; the same on every tp rank
  int64_t valid_tokens = 0;
};
// logits = xf head^T on this rank's columns; the log-sum-exp over the whole vocabulary by an
// all_reduce(max) of the row maxima [n] and one all_reduce(sum) of [n] sums of exponentials
// (rescaled to the global max) packed with [n] target logits (each rank contributes the
// target logit where the target falls in its columns, 0 elsewhere). xf: [n, h] (the same
// rows on every tp rank); head: [V/T, h]; targets: i32 [n] (kIgnoreIndex carries no loss).
// Collective over tp: two all_reduces (none when tp has one rank).
VocabParallelLoss vocab_parallel_cross_entropy(TpComm& tp, const Tensor& xf, const Tensor& head,
                                               const Tensor& targets);
// Backward, in two calls so that the dX collective can run behind the weight gradient:
// d_xf [n, h] written with this rank's PARTIAL gradient (the sum over tp is d(loss)/d(xf):
// reduce it with all_reduce, f's backward, or reduce_scatter_seq, f''s); loss.logits is
// overwritten with d(loss)/d(logits) of this rank's columns. grad_scale =
// d(loss)/d(loss_sum). Not collective.
void vocab_parallel_cross_entropy_backward(Backend& backend, int tp_rank, VocabParallelLoss& loss,
                                           const Tensor& head, const Tensor& targets, double grad_scale,
                                           Tensor& d_xf);
// Then d_head [V/T, h] += d_logits^T xf (the gradient of this rank's vocabulary rows; with
// tied embeddings the embedding's gradient tensor). Not collective.
void vocab_parallel_head_weight_grad(Backend& backend, const VocabParallelLoss& loss, const Tensor& xf,
                                     Tensor& d_head);
// Verification only: the full logits [rows.size(), V] of the chosen rows (indices into n)
// from every rank's columns [n, V/T]: one all_gather of n*V/T elements (none when tp has
// one rank), in the logits' dtype; returned f32. Collective over tp.
Tensor gather_vocab_logits(TpComm& tp, const Tensor& local_logits, std::span<const int64_t> rows);

}  // namespace foldpar
