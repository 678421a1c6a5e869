// The traffic terms of every strategy, written from the same formulas their traffic tests
// assert (see traffic_model.h). Elements times bytes per element; storage dtype (beta) for
// what travels of weights and activations, f32 for gradients, f64 for the loss sums.
#include "plan/traffic_model.h"

namespace foldpar {
namespace {

using u64 = uint64_t;
constexpr u64 kF32 = 4, kF64 = 8, kI32 = 4;

struct Dims {
  u64 B, S, h, f, V, L, g, n_h, n_kv, d;
  bool tied;
};

Dims dims_of(const LlamaConfig& c, int64_t batch, int64_t seq) {
  return Dims{static_cast<u64>(batch),
              static_cast<u64>(seq),
              static_cast<u64>(c.hidden_size),
              static_cast<u64>(c.intermediate_size),
              static_cast<u64>(c.vocab_size),
              static_cast<u64>(c.num_hidden_layers),
              static_cast<u64>(c.group()),
              static_cast<u64>(c.num_attention_heads),
              static_cast<u64>(c.num_key_value_heads),
              static_cast<u64>(c.head_dim()),
              c.tie_word_embeddings};
}

// ---- tsp=D: broadcast attention shards, all-gather K/V, rings of MLP and vocabulary shards ----
AxisTraffic tsp_traffic(const Dims& m, const Layout& l, PlanMode mode, int p) {
  const u64 D = static_cast<u64>(l.tsp), beta = static_cast<u64>(l.storage_bytes()), L = m.L;
  const u64 nb = static_cast<u64>(l.head_buckets), hops = D - 1;
  const u64 attn_shard = (2 * (m.n_h / D) * m.d + 2 * (m.n_kv / D) * m.d) * m.h;
  const u64 W_attn = hops * attn_shard, W_mlp = hops * 3 * (m.f / D) * m.h, W_voc = hops * (m.V / D) * m.h;
  const u64 KV = 2 * m.B * (m.S / D) * m.n_kv * m.d * hops;
  const u64 gathers = D * nb * 2 * m.B;  // per layer: K and V of every unit, one per batch entry
  AxisTraffic a{"tsp", l.tsp, {}};
  if (mode == PlanMode::kDecode) {
    // parallel/decode_block.h: (1 + 2L) all_reduces of [B, h], the logits' all_gather, and
    // per layer an all_gather of [q|k|v] of every rank's heads and the all_to_all of partials.
    for (u64 i = 0; i < 1 + 2 * L; ++i) a.add_all_reduce(1, m.B * m.h, p, kF32);
    a.add(PlanOp::kAllGather, 1, hops * m.B * (m.V / D), kF32);
    a.add(PlanOp::kAllGather, L, L * hops * m.B * (m.n_h / D + 2 * m.n_kv / D) * m.d, kF32);
    a.add(PlanOp::kAllToAll, L, L * hops * m.B * (m.n_h / D) * (m.d + 1), kF32);
    return a;
  }
  const bool head = mode != PlanMode::kPrefill;
  // Forward: shards once, K/V once, the MLP ring, the embedding ring (and the head's).
  a.add(PlanOp::kBroadcast, L * D, L * W_attn, beta);
  a.add(PlanOp::kAllGather, L * gathers, L * KV, beta);
  a.add(PlanOp::kSendRecv, (L + (head ? 2 : 1)) * hops, L * W_mlp + (head ? 2 : 1) * W_voc, beta);
  if (head) a.add_all_reduce(1, 2, p, kF64);  // loss sum and valid count
  if (mode != PlanMode::kTrain) return a;
  const u64 rc = l.recompute == Recompute::kBlock ? 1 : 0;
  const u64 bcasts = rc + (l.keep_weights ? 0 : 1), regathers = rc + (l.keep_kv ? 0 : 1);
  a.add(PlanOp::kBroadcast, bcasts * L * D, bcasts * L * W_attn, beta);
  a.add(PlanOp::kReduce, L * D, L * W_attn, kF32);  // weight gradients to their owners
  a.add(PlanOp::kAllGather, regathers * L * gathers, regathers * L * KV, beta);
  a.add(PlanOp::kReduceScatter, L * gathers, L * KV, beta);  // dK, dV home
  // MLP weights again (and the rerun's), the LM head's weights again; gradient rings of the
  // MLP, the LM head and the embedding (f32).
  a.add(PlanOp::kSendRecv, ((1 + rc) * L + 1) * hops, (1 + rc) * L * W_mlp + W_voc, beta);
  a.add(PlanOp::kSendRecv, (L + 2) * hops, L * W_mlp + 2 * W_voc, kF32);
  a.add_all_reduce(1, (2 * L + 1) * m.h, p, kF32);  // the norm gains' partials, packed
  return a;
}

// ---- the tp axis on N token rows (B*S, or B*S/sp inside tp x sp) ----
AxisTraffic tp_traffic(const Dims& m, const Layout& l, PlanMode mode, u64 rows, int t) {
  const u64 tp_degree = static_cast<u64>(l.tp), L = m.L, n = rows * m.h, beta = static_cast<u64>(l.storage_bytes());
  const bool seqpar = l.sequence_parallel;
  auto G = [&](u64 x) { return x * (tp_degree - 1) / tp_degree; };
  AxisTraffic a{"tp", l.tp, {}};
  if (tp_degree == 1) return a;  // an axis of one rank issues nothing (parallel/megatron/megatron_model.h)
  if (mode == PlanMode::kDecode) {
    for (u64 i = 0; i < 1 + 2 * L; ++i) a.add_all_reduce(1, m.B * m.h, t, kF32);
    a.add(PlanOp::kAllGather, 1, G(tp_degree * m.B * (m.V / tp_degree)), kF32);
    return a;
  }
  auto layer_forward = [&](u64 times) {
    if (seqpar) {
      a.add(PlanOp::kAllGather, 2 * times, 2 * times * G(n), beta);
      a.add(PlanOp::kReduceScatter, 2 * times, 2 * times * G(n), beta);
    } else {
      for (u64 i = 0; i < 2 * times; ++i) a.add_all_reduce(1, n, t, beta);
    }
  };
  layer_forward(L);
  if (seqpar) {
    a.add(PlanOp::kAllGather, 1, G(2 * rows), kI32);  // ids and targets
    a.add(PlanOp::kReduceScatter, 1, G(n), beta);     // embedding (g')
  } else {
    a.add_all_reduce(1, n, t, beta);  // embedding (g)
  }
  if (mode == PlanMode::kPrefill) return a;
  if (seqpar) a.add(PlanOp::kAllGather, 1, G(n), beta);  // xf before the LM head (f')
  a.add_all_reduce(1, rows, t, kF32);                 // loss: row maxima
  a.add_all_reduce(1, 2 * rows, t, kF32);             // loss: sums and target logits
  if (mode != PlanMode::kTrain) return a;
  const bool rc = l.recompute == Recompute::kBlock;
  if (rc) layer_forward(L);
  if (seqpar) {
    a.add(PlanOp::kAllGather, 2 * L, 2 * L * G(n), beta);                        // dY (g'^T)
    if (!rc) a.add(PlanOp::kAllGather, 2 * L, 2 * L * G(n), beta);               // norm outputs again
    a.add(PlanOp::kReduceScatter, 2 * L, 2 * L * G(n), beta);                    // dX (f'^T)
    a.add(PlanOp::kReduceScatter, 1, G(n), beta);                                // d_xf
    a.add(PlanOp::kAllGather, 1, G(n), beta);                                    // embedding dX
    a.add_all_reduce(1, (2 * L + 1) * m.h, t, kF32);                             // norm gains, packed
  } else {
    for (u64 i = 0; i < 2 * L + 1; ++i) a.add_all_reduce(1, n, t, beta);  // dX of the column GEMMs, d_xf
  }
  return a;
}

// ---- the sequence axis of sp=M (weights replicated) or of tp x sp (heads 1/tp) ----
AxisTraffic sp_traffic(const Dims& m, const Layout& l, PlanMode mode, int p, u64 grad_elements) {
  const u64 sp_degree = static_cast<u64>(l.sp), tp_degree = static_cast<u64>(l.tp), L = m.L, hops = sp_degree - 1;
  const u64 beta = static_cast<u64>(l.storage_bytes());
  const u64 KV = 2 * m.B * (m.S / sp_degree) * (m.n_kv / tp_degree) * m.d * hops;
  AxisTraffic a{"sp", l.sp, {}};
  if (sp_degree == 1) return a;  // an axis of one rank issues nothing (parallel/megatron/megatron_model.h)
  auto exchange = [&](u64 times) {
    if ((l.kv_exchange == Layout::KvExchange::kRing)) {
      a.add(PlanOp::kSendRecv, times * L * hops, times * L * KV, beta);
    } else {
      a.add(PlanOp::kAllGather, times * L * 2 * m.B, times * L * KV, beta);
    }
  };
  exchange(1);
  a.add_all_reduce(1, 2, p, kF64);  // loss sum and valid count
  if (mode != PlanMode::kTrain) return a;
  const bool rc = l.recompute == Recompute::kBlock;
  if ((l.kv_exchange == Layout::KvExchange::kRing)) {
    exchange(rc ? 3 : 2);  // (the rerun's,) K/V again, dK/dV home
  } else {
    exchange(1);  // again, or the rerun's kept for the backward
    a.add(PlanOp::kReduceScatter, L * 2 * m.B, L * KV, beta);
  }
  // Every gradient this rank holds, summed over the axis (in messages of at most 2^30).
  constexpr u64 kMaxElements = u64{1} << 30;
  for (u64 begin = 0; begin < grad_elements; begin += kMaxElements)
    a.add_all_reduce(1, std::min(kMaxElements, grad_elements - begin), p, kF32);
  return a;
}

}  // namespace

const char* plan_op_name(PlanOp op) {
  switch (op) {
    case PlanOp::kBroadcast: return "broadcast";
    case PlanOp::kReduce: return "reduce";
    case PlanOp::kAllReduce: return "all_reduce";
    case PlanOp::kAllGather: return "all_gather";
    case PlanOp::kReduceScatter: return "reduce_scatter";
    case PlanOp::kAllToAll: return "all_to_all";
    case PlanOp::kSendRecv: return "send_recv";
  }
  return "?";
}

const char* plan_mode_name(PlanMode m) {
  switch (m) {
    case PlanMode::kTrain: return "train";
    case PlanMode::kForward: return "forward";
    case PlanMode::kPrefill: return "prefill";
    case PlanMode::kDecode: return "decode";
  }
  return "?";
}

OpBytes AxisTraffic::total() const {
  OpBytes t;
  for (const OpBytes& o : ops) {
    t.calls += o.calls;
    t.bytes_sent += o.bytes_sent;
    t.bytes_received += o.bytes_received;
  }
  return t;
}

void AxisTraffic::add(PlanOp kind, uint64_t calls, uint64_t elements, uint64_t bytes_per) {
  OpBytes& o = ops[static_cast<int>(kind)];
  o.calls += calls;
  o.bytes_sent += elements * bytes_per;
  o.bytes_received += elements * bytes_per;
}

void AxisTraffic::add_all_reduce(uint64_t calls, uint64_t n, int p, uint64_t bytes_per) {
  OpBytes& o = ops[static_cast<int>(PlanOp::kAllReduce)];
  o.calls += calls;
  const int N = degree;
  if (N <= 1) return;
  auto block = [&](int i) { return n / N + (static_cast<uint64_t>(i) < n % N ? 1 : 0); };
  const int next = (p + 1) % N, prev = (p - 1 + N) % N;
  o.bytes_sent += (2 * n - block(p) - block(next)) * bytes_per;
  o.bytes_received += (2 * n - block(prev) - block(p)) * bytes_per;
}

const AxisTraffic* StepTraffic::axis(const std::string& name) const {
  for (const AxisTraffic& a : axes)
    if (a.axis == name) return &a;
  return nullptr;
}

OpBytes StepTraffic::total() const {
  OpBytes t;
  for (const AxisTraffic& a : axes) {
    const OpBytes x = a.total();
    t.calls += x.calls;
    t.bytes_sent += x.bytes_sent;
    t.bytes_received += x.bytes_received;
  }
  return t;
}

Result<StepTraffic> predict_traffic(const LlamaConfig& c, const Layout& l, int64_t batch, int64_t seq,
                                    PlanMode mode, const RankCoords& rc) {
  FP_RETURN_IF_ERROR(validate_layout(c, l, batch, seq));
  if ((mode == PlanMode::kPrefill || mode == PlanMode::kDecode) && plan_strategy(l) != PlanStrategy::kTsp &&
      plan_strategy(l) != PlanStrategy::kTp)
    return invalid_argument("{}: {} runs on tsp or tp layouts only", l.to_string(), plan_mode_name(mode));
  if (mode == PlanMode::kPrefill && l.sequence_parallel)
    return invalid_argument("{}: prefill runs plain tensor parallelism, not seqpar", l.to_string());
  // The model axes see one replica's micro-batch: B / dp sequences.
  const Dims m = dims_of(c, batch / l.dp, seq);
  StepTraffic out;
  switch (plan_strategy(l)) {
    case PlanStrategy::kTsp: out.axes.push_back(tsp_traffic(m, l, mode, rc.tsp)); break;
    case PlanStrategy::kTp: out.axes.push_back(tp_traffic(m, l, mode, m.B * m.S, rc.tp)); break;
    case PlanStrategy::kSp:
      out.axes.push_back(sp_traffic(m, l, mode, rc.sp, static_cast<u64>(local_parameter_elements(c, l))));
      break;
    case PlanStrategy::kTpSp:
      out.axes.push_back(tp_traffic(m, l, mode, m.B * m.S / static_cast<u64>(l.sp), rc.tp));
      out.axes.push_back(sp_traffic(m, l, mode, rc.sp, static_cast<u64>(local_parameter_elements(c, l))));
      break;
  }
  if (mode == PlanMode::kTrain && l.dp > 1) {
    // The trainer sums every local gradient over dp (one all_reduce per tensor; counted here
    // as one of all of them, whose bytes differ from the per-tensor sum only by rounding).
    AxisTraffic dp{"dp", l.dp, {}};
    dp.add_all_reduce(1, static_cast<u64>(local_parameter_elements(c, l)), rc.dp, kF32);
    out.axes.push_back(dp);
  }
  return out;
}

double tsp_forward_layer_elements(const LlamaConfig& c, int64_t tokens, int degree) {
  const double D = degree, h = static_cast<double>(c.hidden_size), f = static_cast<double>(c.intermediate_size),
               g = static_cast<double>(c.group()), frac = (D - 1) / D;
  const double q = static_cast<double>(c.q_dim());  // n_h * d (= h unless head_dim is set)
  return (2 + 2 / g) * h * q * frac + 3 * h * f * frac + 2 * static_cast<double>(tokens) * q / g * frac;
}

double tp_forward_layer_elements(const LlamaConfig& c, int64_t tokens, int degree) {
  const double tp = degree;
  return 4 * static_cast<double>(tokens) * static_cast<double>(c.hidden_size) * (tp - 1) / tp;
}

double tsp_tp_forward_crossover_tokens(const LlamaConfig& c) {
  const double h = static_cast<double>(c.hidden_size), f = static_cast<double>(c.intermediate_size),
               g = static_cast<double>(c.group());
  return ((2 + 2 / g) * h + 3 * f) / (4 - 2 / g);
}

}  // namespace foldpar
