// Hardware: what the planner needs to know about a machine, read from a JSON description
// (hardware/*.json): devices per node, memory per device, peak FLOP/s, bandwidth per device
// inside a node and between nodes, and the efficiencies a step-time estimate rests on.
// Every field says its unit; `notes` says where the numbers come from.
//
// The timeline (plan/timeline.h) prices from the finer fields below: GEMM efficiency by shape
// class, attention forward and backward efficiencies, memory bandwidth for token-wise ops, and
// per link class a latency, a bandwidth and a number of concurrent transfers. Every finer field
// is optional and falls back to the coarse one (stated per field), so older files still load.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace foldpar {

struct Hardware {
  std::string name;
  int devices_per_node = 1;            // ranks that share the intra-node links
  double memory_per_device_gb = 0;     // usable by tensors, decimal GB (1e9 bytes)
  double peak_tflops_bf16 = 0;         // dense matmul peak per device, TFLOP/s
  double peak_tflops_f32 = 0;
  double intra_node_gb_per_s = 0;      // per device, each direction, GB/s
  double inter_node_gb_per_s = 0;      // per device (its NIC), each direction, GB/s
  double memory_gb_per_s = 0;          // device memory bandwidth (decode), GB/s; 0: unknown
  double matmul_efficiency = 0.5;      // achieved / peak FLOP/s on a step's GEMMs, (0, 1]
  double attention_efficiency = 0;     // achieved / peak FLOP/s of causal attention (forward and backward,
                                       // model/flop_count.h's count), (0, 1]; 0: as matmul_efficiency
  // Share of overlappable traffic hidden behind compute, [0, 1]: what the deleted FLOP-based
  // estimate priced overlap with. The timeline derives overlap from the schedule itself and
  // does not read it; kept so the files that state it still load.
  double overlap_efficiency = 0.8;
  // GEMM efficiency (achieved / peak of the GEMM's dtype) by shape class: points
  // (min(M, N, K), efficiency), min_dim strictly increasing, efficiency in (0, 1]. Between
  // points linear in log(min_dim); outside them the nearest point. Empty: matmul_efficiency.
  // JSON: "gemm_efficiency_by_min_dim": [[64, 0.3], [1024, 0.9]].
  std::vector<std::pair<double, double>> gemm_efficiency_by_min_dim;
  double attention_fwd_efficiency = 0;  // causal attention forward, achieved / peak, (0, 1]; 0: attention_rate()
  double attention_bwd_efficiency = 0;  // its backward; 0: attention_rate()
  // Causal attention's efficiencies by the keys one call sees (its S_k): points (seq_k,
  // forward, backward), seq_k strictly increasing, efficiencies in (0, 1]; between points
  // linear in log(seq_k), outside them the nearest point. Longer sequences fill the kernel's
  // tiles better (on this machine 1.3x more GFLOP/s at S = 8192 than at 1024). Empty: the
  // two fields above. JSON: "attention_efficiency_by_seq": [[1024, 0.6, 0.5], [4096, 0.8, 0.7]].
  struct AttentionPoint {
    double seq_k = 0, forward = 0, backward = 0;
  };
  std::vector<AttentionPoint> attention_efficiency_by_seq;
  // Per link class: latency of one message step (s), and how many transfers the link carries
  // at once, each at the full per-direction bandwidth above (intra/inter_node_gb_per_s).
  // Latency 0 means unknown (priced as 0); concurrency at least 1.
  double intra_node_latency_s = 0;
  double inter_node_latency_s = 0;
  int intra_node_concurrency = 1;
  int inter_node_concurrency = 1;
  // Per link class: the compute time a transfer costs this rank, as a share of the
  // transfer's own time, [0, kMaxCopyShare]. Where a processor copies the data (MPI over
  // shared memory: the receiver copies out of the peer's pages inside its MPI calls; TCP:
  // the kernel's copies run on the cores that compute), that time is taken from the compute
  // stream: a wait ends no earlier than the wait's start plus this share of the transfer's
  // time, however long ago the transfer began. 0 (the default): copy engines or RDMA move
  // the bytes and a transfer overlaps compute fully. Above 1: the copies also slow the
  // computation beside them (they take memory bandwidth and evict its caches), so a transfer
  // in flight costs more compute time than it takes alone. `foldpar calibrate` measures it
  // (intra-node).
  static constexpr double kMaxCopyShare = 4;
  double intra_node_copy_share = 0;
  double inter_node_copy_share = 0;
  // Per collective kind (plan/timeline.h's names: "all_reduce", "all_gather", ...): achieved
  // / link bandwidth on the ring's counted bytes, (0, 1]; a kind not listed: 1. It is what the
  // library's algorithm costs beyond the ring (extra copies, the reduction's arithmetic).
  // JSON: "collective_efficiency": {"all_reduce": 0.4}.
  std::vector<std::pair<std::string, double>> collective_efficiency;
  // Per link class and transfer kind: the achieved rate by message size, for links whose
  // rate depends on it and on the call's form. A key is a kind above for the blocking call,
  // or "i" + the kind (MPI's and communicator.h's names: "ireduce", "iall_reduce") for the
  // non-blocking one; on this machine's MPI the two run different algorithms (Open MPI's
  // non-blocking reduce is 5-20x slower than its blocking one at 4-64 MiB). Points (bytes,
  // GB/s): bytes as transfer_seconds counts them (max(sent, received), the ring's per-rank
  // bytes), GB/s the rate on those bytes with the latency steps taken out; bytes strictly
  // increasing, GB/s positive. Between points linear in log(bytes), outside them the
  // nearest point. A transfer is priced by its form's table, else (non-blocking) the
  // blocking kind's, and then by it alone (neither the link bandwidth nor
  // collective_efficiency applies); a kind without a table as before. Empty: as before.
  // JSON: "intra_node_gb_per_s_by_bytes": {"ireduce": [[1048576, 0.9], [67108864, 0.2]]}.
  struct SizePoint {
    double bytes = 0, gb_per_s = 0;
  };
  using SizeTables = std::vector<std::pair<std::string, std::vector<SizePoint>>>;  // (kind, points)
  SizeTables intra_node_gb_per_s_by_bytes;
  SizeTables inter_node_gb_per_s_by_bytes;
  // Per token-wise op (the Backend method's name: "rmsnorm_forward", "swiglu_backward", ...):
  // the rate it achieves on the bytes the dry run counts for it (read + written), GB/s,
  // positive. Such ops run below the streaming rate of memory_gb_per_s (several passes over
  // a row, exp and rsqrt, writes of several outputs): on this machine rmsnorm at about a
  // fifth of it, swiglu at about half. An op not listed: memory_gb_per_s. Empty: as before.
  // JSON: "tokenwise_gb_per_s_by_op": {"rmsnorm_forward": 12.5}.
  std::vector<std::pair<std::string, double>> tokenwise_gb_per_s_by_op;
  std::string notes;                   // sources and assumptions
  // Figures a calibration measured beside the fields (name, value; the name says the unit),
  // e.g. a collective's measured and modelled seconds. Informative: nothing prices from it.
  std::vector<std::pair<std::string, double>> measured;

  int64_t memory_bytes() const { return static_cast<int64_t>(memory_per_device_gb * 1e9); }
  double attention_rate() const { return attention_efficiency > 0 ? attention_efficiency : matmul_efficiency; }
  double peak_flops(bool bf16) const { return 1e12 * (bf16 && peak_tflops_bf16 > 0 ? peak_tflops_bf16 : peak_tflops_f32); }
  // The table above at min(M, N, K) = min_dim (interpolated), or matmul_efficiency without one.
  double gemm_efficiency(double min_dim) const;
  double collective_efficiency_of(const std::string& kind) const;
  // The rate (GB/s) a token-wise op is priced at: its tokenwise_gb_per_s_by_op entry, else
  // memory_gb_per_s (0: unknown).
  double tokenwise_gb_per_s(std::string_view op) const;
  // The size table's rate (GB/s) of the key `kind` ("reduce", "ireduce", ...) over the intra-
  // or inter-node link for `bytes` (interpolated as above), or 0 where that link has no table
  // under the key.
  double table_gb_per_s(bool intra_node, const std::string& kind, double bytes) const;
  double attention_fwd_rate() const { return attention_fwd_efficiency > 0 ? attention_fwd_efficiency : attention_rate(); }
  double attention_bwd_rate() const { return attention_bwd_efficiency > 0 ? attention_bwd_efficiency : attention_rate(); }
  // The efficiency of a causal attention call over seq_k keys: attention_efficiency_by_seq
  // interpolated, or attention_fwd_rate() / attention_bwd_rate() without the table.
  double attention_fwd_rate(double seq_k) const;
  double attention_bwd_rate(double seq_k) const;

  // invalid_argument naming the field and value for a missing or out-of-range field.
  Status validate() const;
  static Result<Hardware> from_json(const std::string& text);
  static Result<Hardware> load(const std::string& path);
  std::string to_json() const;
};

}  // namespace foldpar
