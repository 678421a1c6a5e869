// predict_memory (memory_model.h): the parameters, gradients and KV cache a layout holds,
// then the replay of its step (memory_replay.h).
#include "plan/memory_model.h"

#include "plan/memory_replay.h"

namespace foldpar {

using plan_detail::kA;
using plan_detail::kG;
using plan_detail::kK;
using plan_detail::kP;
using plan_detail::Ledger;

Result<MemoryEstimate> predict_memory(const LlamaConfig& c, const Layout& l, const MemoryRequest& r) {
  FP_RETURN_IF_ERROR(validate_layout(c, l, r.batch, r.seq));
  const bool generation = r.mode == PlanMode::kPrefill || r.mode == PlanMode::kDecode;
  if (generation && plan_strategy(l) != PlanStrategy::kTsp && plan_strategy(l) != PlanStrategy::kTp)
    return invalid_argument("{}: {} runs on tsp or tp layouts only", l.to_string(), plan_mode_name(r.mode));
  const int64_t P_local = local_parameter_elements(c, l);
  const int64_t beta = l.storage_bytes(), B = r.batch / l.dp;
  Ledger led;
  led.phase("parameters");
  led.add(kP, beta * P_local);
  // The training model holds its gradients whether or not this step makes any.
  if (r.mode == PlanMode::kTrain || r.mode == PlanMode::kForward) led.add(kG, 4 * P_local);
  if (r.count_batch) led.add(kA, 2 * 4 * B * r.seq / l.token_degree() / (l.sequence_parallel ? l.tp : 1));
  // The KV cache: [B, n_kv (or n_kv/tp), capacity, d] f32 per layer, K and V; TSP holds S/D
  // tokens of every head, TP every token of n_kv/tp heads: the same bytes.
  int64_t cache = 0;
  if (generation) {
    const int64_t D = l.weight_degree(), capacity = r.seq + r.max_new_tokens;
    // tsp places new tokens to keep every rank within one token of the others (parallel/tsp/
    // tsp_decoder.cc plan_capacity): ceil((S + new) / D) slots per sequence.
    const int64_t slots = plan_strategy(l) == PlanStrategy::kTsp ? (capacity + D - 1) / D : capacity;
    const int64_t heads = plan_strategy(l) == PlanStrategy::kTsp ? c.num_key_value_heads : c.num_key_value_heads / D;
    cache = 2 * c.num_hidden_layers * B * slots * heads * c.head_dim() * 4;
  }
  if (r.mode == PlanMode::kDecode) {
    // Weights and cache stay; one step's transients are O(B h) and O(B V/D).
    led.add(kK, cache);
    led.phase("decode step");
    led.touch(kA, 4 * B * (4 * c.hidden_size + c.intermediate_size / l.weight_degree() * 3 + c.vocab_size));
  } else if (plan_strategy(l) == PlanStrategy::kTsp) {
    plan_detail::replay_tsp(c, l, r, cache, led);
  } else {
    plan_detail::replay_tp_sp(c, l, r, cache, led);
  }
  MemoryEstimate e = led.result();
  if (r.mode == PlanMode::kTrain) e.optimizer = 8 * P_local + (beta == 4 ? 0 : 4 * P_local);
  return e;
}

}  // namespace foldpar
