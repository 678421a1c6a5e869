// The memory replay of a TSP step (parallel/tsp/tsp_model.cc, tsp_attention.cc, tsp_mlp.cc,
// tsp_vocab.cc), in the order of its code: see memory_replay.h.
#include <algorithm>
#include <vector>

#include "plan/memory_replay.h"

namespace foldpar::plan_detail {
namespace {

// One rank of tsp=D; T = B*S/D local rows, beta the storage bytes. The block inputs are
// counted with the block that keeps them (saved[l]); the last block's output with the head.
class TspReplay {
 public:
  TspReplay(const LlamaConfig& c, const Layout& l, const MemoryRequest& r, Ledger& led)
      : led_(led), l_(l), mode_(r.mode) {
    D = l.tsp;
    beta = l.storage_bytes();
    B = r.batch / l.dp;
    S = r.seq;
    Sl = S / D;
    T = B * Sl;
    h = c.hidden_size;
    fr = c.intermediate_size / D;
    vr = c.vocab_size / D;
    L = c.num_hidden_layers;
    d = c.head_dim();
    nb = l.head_buckets;
    heads_b = c.num_attention_heads / D / nb;
    kvh_b = c.num_key_value_heads / D / nb;
    attn_shard = (2 * (c.num_attention_heads / D) + 2 * (c.num_key_value_heads / D)) * d * h;
    mlp_shard = 3 * fr * h;
    voc = vr * h;
    recv = std::min<int64_t>(2, D - 1);                  // received shards alive in a ring
    grad_bufs = D == 1 ? 0 : (D == 2 ? 2 : 3);           // gradient-ring buffers alive at once
    unit_full = beta * B * S * kvh_b * d;                // one of K, V of a unit, every position
    train_ = r.mode == PlanMode::kTrain;
    keep_ = train_ && l.recompute == Recompute::kNone;
    bf16_ = beta == 2;
  }

  void run(int64_t kv_cache_bytes) {
    led_.phase("step constants");
    // TspStep: q_pos, k_pos, the RoPE table at the local positions; the norm-gain partials.
    led_.add(kA, 4 * Sl + 4 * S + 4 * Sl * d);
    led_.add(kG, 4 * (2 * L + 1) * h);
    if (kv_cache_bytes > 0) led_.add(kK, kv_cache_bytes);
    led_.phase("embedding ring");
    led_.add(kA, beta * T * h);  // x
    led_.touch(kC, recv * beta * voc);
    std::vector<Bundle> saved(static_cast<size_t>(L));
    forward_blocks(saved);
    if (mode_ == PlanMode::kPrefill) return;
    Bundle head = head_forward();
    if (!train_) return;
    head_backward(head);
    backward_blocks(saved);
    led_.phase("embedding backward");
    led_.touch(kC, grad_bufs * 4 * voc);
    led_.sub(kA, beta * T * h);  // dx
    led_.touch(kC, 4 * (2 * L + 1) * h);  // the packed norm-gain all-reduce
  }

 private:
  void forward_blocks(std::vector<Bundle>& saved) {
    for (int64_t layer = 0; layer < L; ++layer) {
      led_.phase(fmt::format("attention forward, layer {}", layer));
      Bundle& s = saved[static_cast<size_t>(layer)];
      attention_forward(keep_ ? &s : nullptr);
      led_.phase(fmt::format("MLP forward, layer {}", layer));
      mlp_forward(keep_ ? &s : nullptr);
      // The block input: kept (as x_in of the saved block, or the recompute's input) in
      // training, dropped once the block is done otherwise (model/step_order.cc).
      if (train_) s.put(kA, beta * T * h);
      else led_.sub(kA, beta * T * h);
    }
  }

  // The vocabulary-sharded head: returns what it keeps for backward (rstd, xf, lse; x_last,
  // the last block's output, is already live).
  Bundle head_forward() {
    led_.phase("LM head forward");
    Bundle head;
    head.put(kA, 4 * T + beta * T * h);
    head.add_to(led_);
    led_.add(kA, 4 * T);  // lse
    head.put(kA, 4 * T);
    led_.add(kA, 12 * T);  // running max, sum, target logit
    led_.add(kC, recv * beta * voc);
    led_.add(kA, beta * T * vr);  // one logits chunk
    if (bf16_) led_.touch(kW, 4 * (T * h + voc + T * vr));
    led_.sub(kA, beta * T * vr);
    led_.sub(kC, recv * beta * voc);
    led_.sub(kA, 12 * T);
    return head;
  }

  // Leaves dx [T, h] live.
  void head_backward(const Bundle& head) {
    led_.phase("LM head backward");
    led_.add(kA, beta * T * h);  // d_xf
    led_.add(kC, recv * beta * voc + grad_bufs * 4 * voc);
    led_.add(kA, beta * T * vr);
    if (bf16_) led_.touch(kW, 4 * (T * h + voc + T * vr));
    led_.sub(kA, beta * T * vr);
    led_.sub(kC, recv * beta * voc + grad_bufs * 4 * voc);
    const int64_t last_shard = D > 1 ? beta * voc : 0;
    led_.add(kC, last_shard);
    led_.touch(kA, beta * T * h);  // dx, handed on
    led_.sub(kC, last_shard);
    led_.sub(kA, beta * T * h);   // d_xf
    head.sub_from(led_);
    led_.sub(kA, beta * T * h);   // x_last
    led_.add(kA, beta * T * h);   // dx
  }

  void backward_blocks(std::vector<Bundle>& saved) {
    for (int64_t layer = L - 1; layer >= 0; --layer) {
      Bundle& s = saved[static_cast<size_t>(layer)];
      Bundle rerun;
      if (!keep_) {
        led_.phase(fmt::format("recompute, layer {}", layer));
        attention_forward(&rerun);
        mlp_forward(&rerun);
        led_.sub(kA, beta * T * h);  // the rerun's output
      }
      led_.phase(fmt::format("MLP backward, layer {}", layer));
      mlp_backward();
      led_.phase(fmt::format("attention backward, layer {}", layer));
      attention_backward();
      s.sub_from(led_);
      rerun.sub_from(led_);
    }
  }

  // Adds what the block keeps to the ledger and to `s`; transients peak and go.
  void keep(Bundle* s, MemCategory c, int64_t bytes) {
    led_.add(c, bytes);
    if (s) s->put(c, bytes);
  }
  void drop_unless_kept(const Bundle* s, MemCategory c, int64_t bytes) {
    if (!s) led_.sub(c, bytes);
  }

  void attention_forward(Bundle* s) {
    const int64_t units = D * nb;
    const int64_t qkv = beta * T * (heads_b + 2 * kvh_b) * d, out = beta * T * heads_b * d + 4 * T * heads_b;
    keep(s, kA, 4 * T + beta * T * h);  // rstd, a1
    led_.add(kA, beta * T * h);        // y (x_mid): the MLP's input, kept by the MLP
    const bool kept_w = s && l_.keep_weights && train_;
    const int64_t wbytes = (kept_w ? D - 1 : recv) * beta * attn_shard;
    if (kept_w) keep(s, kC, wbytes);
    else led_.add(kC, wbytes);
    const bool kept_kv = s && l_.keep_kv && train_;
    // cur unit allocated; then per unit: next unit, attention output, workspace.
    led_.add(kA, qkv);
    led_.add(kC, 2 * unit_full);
    for (int64_t u = 0; u < units; ++u) {
      if (u + 1 < units) {
        led_.add(kA, qkv);
        led_.add(kC, 2 * unit_full);
      }
      led_.add(kA, out);
      // bf16 storage: the backend widens q, K, V and computes the output in f32 copies.
      const int64_t widened = bf16_ ? 4 * (2 * T * heads_b * d + 2 * B * S * kvh_b * d) : 0;
      led_.touch(kW, flash_workspace(Sl, S, heads_b, kvh_b, d, false) + widened);
      // The unit is done: its q, k, v, attn, lse stay when saved; its gathered K/V when kept.
      if (s) s->put(kA, qkv + out);
      else led_.sub(kA, qkv + out);
      if (kept_kv) s->put(kC, 2 * unit_full);
      else led_.sub(kC, 2 * unit_full);
    }
    if (!kept_w) led_.sub(kC, wbytes);
    drop_unless_kept(s, kA, 4 * T + beta * T * h);
  }

  void mlp_forward(Bundle* s) {
    keep(s, kA, 4 * T + beta * T * h);  // rstd, a2
    led_.add(kA, beta * T * h);        // y: the block output
    led_.add(kC, recv * beta * mlp_shard);
    for (int64_t j = 0; j < D; ++j) {
      led_.add(kA, 3 * beta * T * fr);  // gate, up, act of the step
      // bf16 storage: the widest op's f32 copies (SwiGLU's three, or a GEMM's a2, shard, output)
      if (bf16_) led_.touch(kW, std::max(3 * 4 * T * fr, 4 * (T * h + fr * h + T * fr)));
      if (s) s->put(kA, 3 * beta * T * fr);
      else led_.sub(kA, 3 * beta * T * fr);
    }
    led_.sub(kC, recv * beta * mlp_shard);
    drop_unless_kept(s, kA, 4 * T + beta * T * h);
    // x_mid: saved with the block, or dropped once the MLP is done.
    if (s) s->put(kA, beta * T * h);
    else led_.sub(kA, beta * T * h);
  }

  void mlp_backward() {
    // d_out (dx) is live; d_a2, then per step the weight ring, gradient ring, d_act/d_gate/d_up.
    led_.add(kA, beta * T * h);
    // Per ring step: the weight shards received (in use, arriving), the gradient ring's
    // buffers (this step's partial, the one leaving, the one arriving) and d_act, d_gate,
    // d_up while they compute; at the send (after the model's mlp_backward returned) they are
    // gone and a new incoming buffer exists.
    auto moment = [&](int64_t shards, int64_t grads, int64_t act_tensors) {
      led_.add(kC, shards * beta * mlp_shard + grads * 4 * mlp_shard);
      led_.add(kA, act_tensors * beta * T * fr);
      // bf16 storage: SwiGLU's backward widens gate, up, d_act and computes d_gate, d_up in f32.
      if (bf16_ && act_tensors == 3) led_.touch(kW, std::max(5 * 4 * T * fr, 4 * (T * h + fr * h + T * fr)));
      led_.sub(kA, act_tensors * beta * T * fr);
      led_.sub(kC, shards * beta * mlp_shard + grads * 4 * mlp_shard);
    };
    if (D == 1) {
      moment(0, 0, 3);
    } else if (D == 2) {
      moment(1, 1, 3);
      moment(1, 2, 0);
    } else if (D == 3) {
      moment(2, 1, 3);
      moment(2, 2, 0);
      moment(1, 3, 3);
    } else {
      moment(2, 3, 3);
    }
    const int64_t last_shard = D > 1 ? beta * mlp_shard : 0;
    led_.add(kC, last_shard);
    led_.touch(kA, beta * T * h);  // dx
    led_.sub(kC, last_shard);
    led_.sub(kA, beta * T * h);  // d_a2; d_out replaced by dx (same size)
  }

  void attention_backward() {
    led_.add(kA, beta * T * h);  // d_a1
    const int64_t w = l_.keep_weights ? 0 : recv * beta * attn_shard;
    const int64_t gb = recv * 4 * attn_shard;
    led_.add(kC, w + gb);
    const int64_t full = l_.keep_kv ? 0 : 2 * unit_full;  // K/V gathered again
    const int64_t q_side = 2 * beta * T * heads_b * d;    // d_attn, dq
    led_.add(kC, full + 2 * unit_full);                   // and dK, dV of every position
    led_.add(kA, q_side);
    // bf16 storage: q, K, V, out, d_out widened; dq, dK, dV computed in f32 copies.
    const int64_t widened = bf16_ ? 4 * (3 * T * heads_b * d + 4 * B * S * kvh_b * d) : 0;
    led_.touch(kW, flash_workspace(Sl, S, heads_b, kvh_b, d, true) + widened);
    led_.sub(kC, full);
    led_.touch(kA, 2 * beta * T * kvh_b * d);  // dk, dv of the local tokens
    led_.sub(kA, q_side);
    led_.sub(kC, 2 * unit_full);
    led_.sub(kC, w + gb);
    led_.touch(kA, beta * T * h);  // dx
    led_.sub(kA, beta * T * h);    // d_a1
  }

  Ledger& led_;
  const Layout& l_;
  PlanMode mode_;
  bool train_ = false, keep_ = false, bf16_ = false;
  int64_t D, beta, B, S, Sl, T, h, fr, vr, L, d, nb, heads_b, kvh_b;
  int64_t attn_shard, mlp_shard, voc, recv, grad_bufs, unit_full;
};

}  // namespace

void replay_tsp(const LlamaConfig& c, const Layout& l, const MemoryRequest& r, int64_t kv_cache_bytes,
                Ledger& led) {
  TspReplay(c, l, r, led).run(kv_cache_bytes);
}

int64_t flash_workspace(int64_t sq, int64_t sk, int64_t heads, int64_t kv_heads, int64_t d, bool backward) {
  constexpr int64_t kStackedRows = 256, kKeyBlock = 256, kLanes = 16;
  const int64_t g = heads / kv_heads;
  const int64_t rows_max = std::max<int64_t>(1, std::min(kStackedRows / g, sq)) * g;
  const int64_t keys = std::max<int64_t>(1, std::min(kKeyBlock, sk));
  auto line = [](int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; };
  const int64_t mat = line(rows_max * d), sc = line(rows_max * keys), vec = line(rows_max);
  const int64_t head = kv_heads == 1 ? 0 : line(sk * d);
  const int64_t floats = (backward ? 3 : 2) * mat + (backward ? 2 : 1) * sc + 2 * vec + (backward ? 4 : 2) * head;
  return 4 * floats + 4 * 2 * ((sk + keys - 1) / keys);
}

}  // namespace foldpar::plan_detail
