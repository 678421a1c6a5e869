// The memory replay of the Megatron strategy's steps on the layouts tp, sp and tp x sp
// (parallel/megatron/tp_step_base.cc, tp_layers.cc, megatron_attention.cc, megatron_step.cc;
// parallel/ring_attention.cc), in the order of their code: see memory_replay.h. On the tp
// group of this rank every weight is 1/tp; the group holds N = B*S/sp token rows (R = N/tp per
// rank with seqpar, tp > 1 only); attention of the local queries runs over every position's
// K/V (gathered over sp, or the ring), the local ones when sp = 1.
#include <algorithm>
#include <vector>

#include "plan/memory_replay.h"

namespace foldpar::plan_detail {
namespace {

// One rank of tp, sp or tp x sp; bt the storage bytes (statistics, logits f32).
class TpSpReplay {
 public:
  TpSpReplay(const LlamaConfig& c, const Layout& l, const MemoryRequest& r, Ledger& led)
      : led_(led), mode_(r.mode) {
    tp = l.tp;
    bt = l.storage_bytes();
    sp = l.sp;
    B = r.batch / l.dp;
    S = r.seq;
    Sl = S / sp;
    N = B * Sl;
    R = l.sequence_parallel && tp > 1 ? N / tp : N;
    h = c.hidden_size;
    fr = c.intermediate_size / tp;
    vr = c.vocab_size / tp;
    L = c.num_hidden_layers;
    d = c.head_dim();
    hl = c.num_attention_heads / tp;
    kvl = c.num_key_value_heads / tp;
    seqpar = l.sequence_parallel && tp > 1;
    gather = sp > 1 && l.kv_exchange != Layout::KvExchange::kRing;
    ring = sp > 1 && l.kv_exchange == Layout::KvExchange::kRing;
    staging = seqpar && B > 1 && tp > 1 ? bt * N * h : 0;
    full_kv = bt * B * S * kvl * d;  // one of K, V gathered over sp
    packed = 2 * bt * B * Sl * kvl * d;  // one ring block: K and V of one rank's tokens
    train_ = r.mode == PlanMode::kTrain;
    keep_ = train_ && l.recompute == Recompute::kNone;
  }

  void run(int64_t kv_cache_bytes) {
    led_.phase("step constants");
    if (seqpar) {
      led_.touch(kA, 8 * R + 8 * N);  // packed ids/targets and their gather
      led_.add(kA, 8 * N);            // every token's ids and targets
      if (sp == 1) led_.add(kG, 4 * (2 * L + 1) * h);  // the gains' partials (sp > 1: in the gradients)
    }
    led_.add(kA, sp > 1 ? 4 * Sl + 4 * S : 4 * S);  // q_pos, k_pos (the same tensor when sp = 1)
    led_.add(kA, 4 * Sl * d);  // the RoPE table
    if (kv_cache_bytes > 0) led_.add(kK, kv_cache_bytes);
    embed();
    std::vector<Bundle> saved(static_cast<size_t>(L));
    forward_blocks(saved);
    if (mode_ == PlanMode::kPrefill) return;
    Bundle head = head_forward();
    if (!train_) return;
    head_backward(head);
    backward_blocks(saved);
    led_.phase("embedding backward");
    if (seqpar) led_.touch(kC, bt * N * h + staging);
    led_.sub(kA, bt * R * h);
    if (seqpar && sp == 1) led_.touch(kC, 4 * (2 * L + 1) * h);  // the gains' packed partials
  }

 private:
  // Leaves x [R, h] live.
  void embed() {
    led_.phase("embedding");
    const int64_t partial = bt * N * h;
    led_.add(seqpar ? kC : kA, partial);
    if (seqpar) {
      led_.add(kA, bt * R * h);
      led_.touch(kC, staging);
      led_.sub(kC, partial);
    }
  }

  void forward_blocks(std::vector<Bundle>& saved) {
    for (int64_t layer = 0; layer < L; ++layer) {
      Bundle& s = saved[static_cast<size_t>(layer)];
      Bundle* target = keep_ ? &s : nullptr;
      led_.phase(fmt::format("attention forward, layer {}", layer));
      attention_forward(target, false);
      led_.phase(fmt::format("MLP forward, layer {}", layer));
      mlp_forward(target, false);
      // x_in: the saved block's or the recompute's input; otherwise dropped (the caller
      // holds the embedding output until the block loop returns).
      if (train_) s.put(kA, bt * R * h);
      else if (layer > 0) led_.sub(kA, bt * R * h);
    }
    if (!train_) led_.sub(kA, bt * R * h);
  }

  // Final norm, LM head and loss; returns what is kept for backward (rstd, xf or xf_full,
  // the local logits [N, V/tp], lse; x_last is already live).
  Bundle head_forward() {
    led_.phase("LM head forward");
    Bundle head;
    led_.add(kA, 4 * R + bt * R * h);  // rstd, xf
    if (seqpar) {
      led_.add(kC, bt * N * h);  // xf_full
      led_.touch(kC, staging);
    }
    led_.add(kA, 4 * N * vr);   // the local logits, kept for backward
    led_.touch(kA, 4 * N * 4);  // local and global maxima, sums and target logits
    led_.add(kA, 4 * N);        // lse
    if (seqpar) led_.sub(kA, bt * R * h);  // xf itself (xf_full is kept)
    head.put(kA, 4 * R + (seqpar ? 0 : bt * R * h) + 4 * N * vr + 4 * N);
    if (seqpar) head.put(kC, bt * N * h);
    return head;
  }

  // Leaves dx [R, h] live.
  void head_backward(Bundle& head) {
    led_.phase("LM head backward");
    const int64_t partial = bt * N * h;
    led_.add(seqpar ? kC : kA, partial);
    if (seqpar) led_.add(kA, bt * R * h);  // d_xf
    led_.touch(kC, staging);
    led_.sub(kA, 4 * N * vr);  // logits dropped after the weight gradient
    head.bytes[static_cast<int>(kA)] -= 4 * N * vr;
    // xf_full dropped with them (plain: it is xf itself)
    led_.sub(seqpar ? kC : kA, seqpar ? bt * N * h : bt * R * h);
    head.bytes[static_cast<int>(seqpar ? kC : kA)] -= seqpar ? bt * N * h : bt * R * h;
    led_.touch(kA, bt * R * h);  // dx
    led_.sub(seqpar ? kC : kA, partial);
    if (seqpar) led_.sub(kA, bt * R * h);
    head.sub_from(led_);
    led_.sub(kA, bt * R * h);  // x_last
    led_.add(kA, bt * R * h);  // dx
  }

  void backward_blocks(std::vector<Bundle>& saved) {
    for (int64_t layer = L - 1; layer >= 0; --layer) {
      Bundle& s = saved[static_cast<size_t>(layer)];
      Bundle rerun;
      if (!keep_) {
        led_.phase(fmt::format("recompute, layer {}", layer));
        attention_forward(&rerun, true);
        mlp_forward(&rerun, true);
        led_.sub(kA, bt * R * h);  // the rerun's output
      }
      led_.phase(fmt::format("MLP backward, layer {}", layer));
      mlp_backward(!keep_);
      led_.phase(fmt::format("attention backward, layer {}", layer));
      attention_backward(!keep_);
      s.sub_from(led_);
      rerun.sub_from(led_);
    }
  }

  void keep(Bundle* s, MemCategory c, int64_t bytes) {
    led_.add(c, bytes);
    if (s) s->put(c, bytes);
  }
  void release(Bundle* s, MemCategory c, int64_t bytes) {
    if (!s) led_.sub(c, bytes);
  }
  // Rows this rank's norm output is gathered to for the column-parallel GEMMs.
  int64_t gathered() const { return seqpar ? bt * N * h : 0; }

  // The partial of a row-parallel GEMM and its reduction into y [R, h] (kept as the output).
  void reduce_into_output() {
    if (seqpar) {
      led_.add(kC, bt * N * h);
      led_.add(kA, bt * R * h);
      led_.touch(kC, staging);
      led_.sub(kC, bt * N * h);
    } else {
      led_.add(kA, bt * N * h);  // reduced in place: the partial is the output
    }
  }

  void attention_forward(Bundle* s, bool keep_gathered) {
    keep(s, kA, 4 * R + bt * R * h);  // rstd, a1
    led_.add(kC, gathered());        // a1_full
    led_.touch(kC, staging);
    const int64_t qkv = bt * N * (hl + 2 * kvl) * d, out = bt * N * hl * d + 4 * N * hl;
    keep(s, kA, qkv);
    if (gather) led_.add(kC, 2 * full_kv);
    keep(s, kA, out);
    if (ring) {
      // parallel/ring_attention.cc: this rank's packed K|V block and the one arriving, a
      // block's output and lse before the merge, the block's flash workspace.
      led_.add(kC, 2 * packed);
      led_.touch(kW, bt * N * hl * d + 4 * N * hl + flash_workspace(Sl, Sl, hl, kvl, d, false));
      led_.sub(kC, 2 * packed);
    } else {
      led_.touch(kW, flash_workspace(Sl, gather ? S : Sl, hl, kvl, d, false));
    }
    const bool kept_kv = gather && keep_gathered;
    if (gather) {
      if (kept_kv) s->put(kC, 2 * full_kv);
      else led_.sub(kC, 2 * full_kv);
    }
    const bool kept_a1 = seqpar && keep_gathered;
    if (kept_a1) s->put(kC, gathered());
    reduce_into_output();  // y = x_mid, the MLP's input
    if (!kept_a1) led_.sub(kC, gathered());
    release(s, kA, 4 * R + bt * R * h + qkv + out);
  }

  void mlp_forward(Bundle* s, bool keep_gathered) {
    keep(s, kA, 4 * R + bt * R * h);  // rstd, a2
    led_.add(kC, gathered());
    led_.touch(kC, staging);
    keep(s, kA, 3 * bt * N * fr);  // gate, up, act
    const bool kept_a2 = seqpar && keep_gathered;
    if (kept_a2) s->put(kC, gathered());
    reduce_into_output();
    if (!kept_a2) led_.sub(kC, gathered());
    release(s, kA, 4 * R + bt * R * h + 3 * bt * N * fr);
    if (s) s->put(kA, bt * R * h);  // x_mid
    else led_.sub(kA, bt * R * h);
  }

  void mlp_backward(bool rerun_kept_gathered) {
    // d_out is live. dy and a2_full with seqpar (a2_full kept by a rerun).
    const int64_t dy = seqpar ? bt * N * h : 0, a2 = seqpar && !rerun_kept_gathered ? bt * N * h : 0;
    led_.add(kC, dy);
    led_.touch(kC, staging);  // dy's gather, waited at once
    // a2 gathered again, its staging held until the wait after the dX reduce-scatter starts
    const int64_t a2_stage = a2 > 0 ? staging : 0;
    led_.add(kC, a2 + a2_stage);
    led_.add(kA, bt * N * fr);  // d_act
    led_.add(kA, 2 * bt * N * fr);  // d_gate, d_up
    led_.sub(kA, bt * N * fr);
    const int64_t partial = bt * N * h, reduced = seqpar ? bt * R * h : 0;
    led_.add(seqpar ? kC : kA, partial);
    led_.add(kA, reduced);
    led_.touch(kC, staging);
    led_.sub(kC, a2_stage);
    led_.touch(kA, bt * R * h);  // dx
    led_.sub(seqpar ? kC : kA, partial);
    led_.sub(kA, reduced);
    led_.sub(kA, 2 * bt * N * fr);
    led_.sub(kC, dy + a2);
  }

  void attention_backward(bool rerun_kept_gathered) {
    const int64_t dy = seqpar ? bt * N * h : 0, a1 = seqpar && !rerun_kept_gathered ? bt * N * h : 0;
    led_.add(kC, dy);
    led_.touch(kC, staging);  // dy's gather, waited at once
    // a1 gathered again, its staging held until the wait after the dX reduce-scatter starts
    const int64_t a1_stage = a1 > 0 ? staging : 0;
    led_.add(kC, a1 + a1_stage);
    const int64_t kv = gather && !rerun_kept_gathered ? 2 * full_kv : 0;
    const int64_t d_attn = bt * N * hl * d, dqkv = bt * N * (hl + 2 * kvl) * d;
    led_.add(kC, kv);
    led_.add(kA, d_attn + dqkv);
    if (gather) {
      led_.add(kC, 2 * full_kv);  // dK, dV of every position
      led_.touch(kW, flash_workspace(Sl, S, hl, kvl, d, true));
      led_.sub(kC, kv);
      led_.sub(kC, 2 * full_kv);
    } else if (ring) {
      // The K|V blocks in use and arriving, the step's dK|dV partial, this rank's own
      // accumulator and the travelling ones (2 ranks: 3 at the attention, 4 after; 3: 5; more:
      // 6), with the step's dq and the flash workspace.
      const int64_t blocks = sp == 2 ? 3 : (sp == 3 ? 5 : 6);
      led_.add(kC, blocks * packed);
      led_.touch(kW, bt * N * hl * d + flash_workspace(Sl, Sl, hl, kvl, d, true));
      led_.sub(kC, blocks * packed);
      if (sp == 2) led_.touch(kC, 4 * packed);
    } else {
      led_.touch(kW, flash_workspace(Sl, Sl, hl, kvl, d, true));
    }
    led_.sub(kA, d_attn);
    const int64_t partial = bt * N * h, reduced = seqpar ? bt * R * h : 0;
    led_.add(seqpar ? kC : kA, partial);
    led_.add(kA, reduced);
    led_.touch(kC, staging);
    led_.sub(kC, a1_stage);
    led_.touch(kA, bt * R * h);  // dx
    led_.sub(seqpar ? kC : kA, partial);
    led_.sub(kA, reduced);
    led_.sub(kA, dqkv);
    led_.sub(kC, dy + a1);
  }

  Ledger& led_;
  PlanMode mode_;
  bool train_ = false, keep_ = false, seqpar = false, gather = false, ring = false;
  int64_t bt, tp, sp, B, S, Sl, N, R, h, fr, vr, L, d, hl, kvl, staging, full_kv, packed;
};

}  // namespace

void replay_tp_sp(const LlamaConfig& c, const Layout& l, const MemoryRequest& r, int64_t kv_cache_bytes,
                  Ledger& led) {
  TpSpReplay(c, l, r, led).run(kv_cache_bytes);
}

}  // namespace foldpar::plan_detail
