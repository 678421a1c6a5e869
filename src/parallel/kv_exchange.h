// Exchanging K/V across a sequence-sharded axis (TSP, SP, TP x SP): each rank's
// [B, S_local, n, d] rows gathered into [B, S, n, d] in RANK order (rank r's rows at
// [r*S_local, (r+1)*S_local) of every batch entry), which attention reads through the
// gathered position array (SequenceShard::gathered_positions), so no reordering is needed.
// One collective per batch entry, so each lands directly in its [S, ...] block.
//   fwd: all_gather over the axis; bwd: reduce_scatter (the adjoint: the gradient of every
//   position summed over the ranks that used it, each rank receiving its own rows).
#pragma once

#include <vector>

#include "comm/communicator.h"
#include "tensor/tensor.h"

namespace foldpar {

// local: [B, S_local, ...] f32; full: [B, S_local * size, ...], written. Non-blocking: the
// requests must be waited before `full` is read or `local` is modified.
std::vector<CommRequest> start_gather_kv(Communicator& axis, const Tensor& local, Tensor& full);
// full: [B, S, ...] f32; local: [B, S/size, ...] written with the axis sum of this rank's rows.
std::vector<CommRequest> start_reduce_scatter_kv(Communicator& axis, const Tensor& full, Tensor& local);

}  // namespace foldpar
