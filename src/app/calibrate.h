// `foldpar calibrate`: this machine measured into a hardware description (plan/hardware.h),
// every rank of `world` a device of one node, all ranks measuring at once (the cores are
// shared as in a real step) on the CPU backend with one thread; each rate is the slowest
// rank's.
//
// What it measures, and into which field:
//  - f32 GEMM [M x 1024] x [1024 x 1024] for M = 32 .. 1024: peak_tflops_f32 (the best) and
//    gemm_efficiency_by_min_dim (each over the best; min(M, N, K) = M);
//  - causal flash attention forward and backward (S = 1024, 8 heads of 64):
//    attention_fwd_efficiency, attention_bwd_efficiency and attention_efficiency (both);
//  - add_inplace over 64 MiB tensors (3 x 64 MiB moved): memory_gb_per_s;
//  - a ring send_recv between ranks of 4 bytes (latency) and 16 MiB (bandwidth):
//    intra_node_latency_s and intra_node_gb_per_s, inter-node set equal (one node);
//  - all_reduce, all_gather and reduce_scatter of a few bytes and of 16 MiB: in `measured`,
//    each beside what the timeline's ring model (plan/timeline.h transfer_seconds) predicts
//    from the link figures; the 16 MiB ones give collective_efficiency (what the MPI
//    library's algorithm costs beyond the ring's counted bytes);
//  - send_recv, all_reduce, all_gather, reduce_scatter, broadcast and reduce of 1, 4, 16
//    and 64 MiB, blocking and as the i-form waited at once (shared-memory MPI's rate falls
//    with the size, and its non-blocking reduce runs another algorithm):
//    intra_node_gb_per_s_by_bytes, inter-node set equal;
//  - the rest of a single-rank training step (h = 512, L = 2, S = 1024, attention taken out):
//    matmul_efficiency, which the planner's coarse estimate uses.
// overlap_efficiency and the link concurrency (1) are stated, not measured.
#pragma once

#include "comm/communicator.h"
#include "core/status.h"
#include "plan/hardware.h"

namespace foldpar {

// Collective over `world`; invalid_argument with fewer than 2 ranks (the links need a peer).
Result<Hardware> calibrate_hardware(Communicator& world);

}  // namespace foldpar
