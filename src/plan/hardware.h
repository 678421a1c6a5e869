// Hardware: what the planner needs to know about a machine, read from a JSON description
// (hardware/*.json): devices per node, memory per device, peak FLOP/s, bandwidth per device
// inside a node and between nodes, and the efficiencies a step-time estimate rests on.
// Every field says its unit; `notes` says where the numbers come from.
#pragma once

#include <cstdint>
#include <string>

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
  double overlap_efficiency = 0.8;     // share of overlappable traffic hidden behind compute, [0, 1]
  std::string notes;                   // sources and assumptions

  int64_t memory_bytes() const { return static_cast<int64_t>(memory_per_device_gb * 1e9); }
  double attention_rate() const { return attention_efficiency > 0 ? attention_efficiency : matmul_efficiency; }
  double peak_flops(bool bf16) const { return 1e12 * (bf16 && peak_tflops_bf16 > 0 ? peak_tflops_bf16 : peak_tflops_f32); }

  // invalid_argument naming the field and value for a missing or out-of-range field.
  Status validate() const;
  static Result<Hardware> from_json(const std::string& text);
  static Result<Hardware> load(const std::string& path);
  std::string to_json() const;
};

}  // namespace foldpar
