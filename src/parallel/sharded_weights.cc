// Packing, unpacking and initialization of weight shards.
#include "parallel/sharded_weights.h"

#include <fmt/format.h>

#include "comm/communicator.h"
#include "model/init_values.h"
#include "model/moe_weights.h"

namespace foldpar {

void for_each_moe_slice(ShardedWeights& w, size_t l,
                        const std::function<void(const GlobalSlice&, Tensor&, bool replicated)>& fn) {
  if (l >= w.moe.size() || !w.moe[l].defined()) return;
  MoeLayerWeights& m = w.moe[l];
  const ShardDims& d = w.dims;
  // A view of the whole layer with only this rank's experts defined, for the family's names.
  MoeLayerWeights all;
  all.router = m.router;
  all.shared = m.shared;
  all.shared_gate = m.shared_gate;
  const int owner = w.expert_owner();
  const int64_t local = static_cast<int64_t>(m.experts.size()), e0 = local > 0 ? d.expert0(owner) : 0;
  const int64_t E = local == 0 ? 0 : (d.expert_group > 1 ? d.expert_degree / d.expert_group : local * d.expert_degree);
  all.experts.resize(static_cast<size_t>(E));
  for (int64_t j = 0; j < local; ++j) all.experts[static_cast<size_t>(e0 + j)] = m.experts[j];
  // A slice's rows (gate, up) or columns (down) of f_e; the whole width when experts are whole.
  const int64_t f0 = d.expert_slice(owner) * d.expert_rows, fe = d.expert_rows * d.expert_group;
  for_each_moe_tensor(fmt::format("model.layers.{}.", l), w.moe_family, all, [&](const std::string& name, Tensor& t) {
    if (!t.defined()) return;
    const bool replicated = name.find(".experts.") == std::string::npos;
    GlobalSlice where{name, 0, t.numel() / t.dim(-1), 0, t.dim(-1), false, 0};
    if (!replicated) {
      const bool down = is_expert_down_projection(name);
      (down ? where.col0 : where.row0) = f0;
      FP_CHECK((down ? where.col0 + where.cols : where.row0 + where.rows) <= fe,
               "MoE slice of {} at rows {}+{}, columns {}+{} (f_e {})", name, where.row0, where.rows, where.col0,
               where.cols, fe);
    }
    fn(where, t, replicated);
  });
}

void for_each_moe_shard(ShardedWeights& w, size_t l,
                        const std::function<void(const std::string&, Tensor&, bool replicated)>& fn) {
  for_each_moe_slice(w, l, [&](const GlobalSlice& where, Tensor& t, bool rep) { fn(where.tensor, t, rep); });
}

namespace {

// Element (i, j) of a [rows, h] row block `dst` corresponds to global element
// (row0 + i, j) of a [*, h] tensor, or, transposed, to (j, col0 + i) of an [h, cols] tensor.
template <typename Fn>
void for_each_row_block(int64_t rows, int64_t h, Fn&& fn) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < h; ++j) fn(i, j);
}

// Not a step path: these move shards to and from global tensors for init, checkpoints,
// import/export and verification, through host copies (Tensor::copy_to_host/copy_from_host,
// so they work on device memory too).
// Copies between a packed row block (f32 or bf16) and an f32 global tensor; `to_global`
// picks the direction.
void copy_rows(Tensor block, const Tensor& global, int64_t row0, bool to_global) {
  const int64_t rows = block.dim(0), h = block.dim(1);
  FP_CHECK(global.dim(1) == h && global.dtype() == DType::kF32 &&
               (block.dtype() == DType::kF32 || block.dtype() == DType::kBF16),
           "row block {} of {}", block.describe(), global.describe());
  Tensor g = global.reshape({global.numel() / h, h}).narrow(row0, row0 + rows);
  if (to_global) {
    write_host_f32(read_host_f32(block), g);
  } else {
    write_host_f32(read_host_f32(g), block);
  }
}
void copy_cols_t(Tensor block, const Tensor& global, int64_t col0, bool to_global) {
  const int64_t rows = block.dim(0), h = block.dim(1), cols = global.dim(1);
  FP_CHECK(global.dim(0) == h && global.dtype() == DType::kF32 &&
               (block.dtype() == DType::kF32 || block.dtype() == DType::kBF16),
           "transposed block {} of {}", block.describe(), global.describe());
  std::vector<float> g = read_host_f32(global);
  std::vector<float> b = to_global ? read_host_f32(block) : std::vector<float>(static_cast<size_t>(rows * h));
  for_each_row_block(rows, h, [&](int64_t i, int64_t j) {
    float& gv = g[static_cast<size_t>(j * cols + col0 + i)];
    float& bv = b[static_cast<size_t>(i * h + j)];
    if (to_global) gv = bv;
    else bv = gv;
  });
  Tensor global_view = global;
  if (to_global) {
    write_host_f32(g, global_view);
  } else {
    write_host_f32(b, block);
  }
}

// Copies between a local vector (or part of one) and a global 1-D tensor's elements [at, at + n).
void copy_span(Tensor local, const Tensor& global, int64_t at, bool to_global) {
  const int64_t n = local.numel();
  Tensor g = global.reshape({global.numel()}).narrow(at, at + n);
  Tensor l = local.reshape({n});
  if (to_global) {
    write_host_f32(read_host_f32(l), g);
  } else {
    write_host_f32(read_host_f32(g), l);
  }
}

// Copies between a local tensor and its block `at` of a global tensor (not transposed; a
// MoE expert's slice, or the whole tensor).
void copy_block(Tensor local, const Tensor& global, const GlobalSlice& at, bool to_global) {
  const int64_t cols = global.dim(-1);
  FP_CHECK(!at.transposed && local.numel() == at.rows * at.cols && at.col0 + at.cols <= cols &&
               (at.row0 + at.rows) * cols <= global.numel(),
           "block {}+{} x {}+{} of {} for {}", at.row0, at.rows, at.col0, at.cols, global.describe(), local.describe());
  std::vector<float> g = read_host_f32(global);
  std::vector<float> b = to_global ? read_host_f32(local) : std::vector<float>(static_cast<size_t>(local.numel()));
  for (int64_t i = 0; i < at.rows; ++i)
    for (int64_t j = 0; j < at.cols; ++j) {
      float& gv = g[static_cast<size_t>((at.row0 + i) * cols + at.col0 + j)];
      float& bv = b[static_cast<size_t>(i * at.cols + j)];
      if (to_global) gv = bv;
      else bv = gv;
    }
  Tensor global_view = global;
  if (to_global) {
    write_host_f32(g, global_view);
  } else {
    write_host_f32(b, local);
  }
}

Tensor element_of(const std::vector<Tensor>& v, size_t i) { return i < v.size() ? v[i] : Tensor(); }

// The attention variants' tensors of layer l (sharded_weights.h): to or from the global ones.
void move_variants(ShardedWeights& s, size_t l, LayerWeights& lw, bool to_global, bool replicated) {
  if (!replicated) return;
  const int64_t q = lw.bq.defined() ? lw.bq.numel() : 0, kv = lw.bk.defined() ? lw.bk.numel() : 0;
  if (Tensor b = element_of(s.qkv_bias, l); b.defined()) {
    copy_span(b.narrow(0, q), lw.bq, 0, to_global);
    copy_span(b.narrow(q, q + kv), lw.bk, 0, to_global);
    copy_span(b.narrow(q + kv, q + 2 * kv), lw.bv, 0, to_global);
  }
  if (Tensor b = element_of(s.o_bias, l); b.defined()) copy_span(b, lw.bo, 0, to_global);
  if (Tensor n = element_of(s.qk_norm, l); n.defined()) {
    copy_span(n.narrow(0, 1), lw.q_norm, 0, to_global);
    copy_span(n.narrow(1, 2), lw.k_norm, 0, to_global);
  }
  if (Tensor b = element_of(s.mlp_bias, l); b.defined()) {
    const int64_t f = lw.b_gate.numel();
    copy_span(b.narrow(0, f), lw.b_gate, 0, to_global);
    copy_span(b.narrow(f, 2 * f), lw.b_up, 0, to_global);
  }
  if (Tensor b = element_of(s.down_bias, l); b.defined()) copy_span(b, lw.b_down, 0, to_global);
}

void move_shards(ShardedWeights& s, LlamaWeights& g, bool to_global, bool replicated) {
  const ShardDims& d = s.dims;
  const int r = s.owner;
  for (size_t l = 0; l < s.attn.size(); ++l) {
    if (!s.attn[l].defined()) continue;  // another pipeline stage's layer
    AttnPieces a = attn_pieces(d, s.attn[l]);
    const LayerWeights& lw = g.layers[l];
    copy_rows(a.wq, lw.wq, r * d.q_rows, to_global);
    // A KV replica (d.kv_group > 1) writes into the global tensor only from its group's first
    // rank: the others hold the same values.
    if (!to_global || r == d.kv_group_first(r)) {
      copy_rows(a.wk, lw.wk, d.kv_head0(r) * d.d, to_global);
      copy_rows(a.wv, lw.wv, d.kv_head0(r) * d.d, to_global);
    }
    copy_cols_t(a.wo_t, lw.wo, r * d.q_rows, to_global);
    move_variants(s, l, g.layers[l], to_global, replicated);
    if (s.mlp[l].defined()) {
      MlpPieces m = mlp_pieces(d, s.mlp[l]);
      copy_rows(m.w_gate, lw.w_gate, r * d.f_rows, to_global);
      copy_rows(m.w_up, lw.w_up, r * d.f_rows, to_global);
      copy_cols_t(m.w_down_t, lw.w_down, r * d.f_rows, to_global);
    }
    if (l < s.moe.size() && s.moe[l].defined()) {
      // Whole tensors by name: the layer's global tensors visited under the same names.
      std::vector<std::pair<std::string, Tensor>> global;
      for_each_moe_tensor(fmt::format("model.layers.{}.", l), g.moe_family, g.layers[l].moe,
                          [&](const std::string& name, Tensor& t) { global.emplace_back(name, t); });
      for_each_moe_slice(s, l, [&](const GlobalSlice& at, Tensor& t, bool rep) {
        if (rep && !replicated) return;
        for (auto& [gname, gt] : global)
          if (gname == at.tensor) {
            copy_block(t, gt, at, to_global);
            return;
          }
        FP_CHECK(false, "no global tensor {}", at.tensor);
      });
    }
    if (replicated) {
      copy_rows(s.attn_norm[l].reshape({1, d.h}), lw.attn_norm.reshape({1, d.h}), 0, to_global);
      copy_rows(s.mlp_norm[l].reshape({1, d.h}), lw.mlp_norm.reshape({1, d.h}), 0, to_global);
    }
  }
  if (s.embed.defined()) copy_rows(s.embed, g.embed, r * d.v_rows, to_global);
  if (!s.tied && s.lm_head.defined()) copy_rows(s.lm_head, g.lm_head, r * d.v_rows, to_global);
  if (replicated && s.final_norm.defined())
    copy_rows(s.final_norm.reshape({1, d.h}), g.final_norm.reshape({1, d.h}), 0, to_global);
}

}  // namespace

ShardDims shard_dims(const LlamaConfig& c, int D, int expert_degree) {
  // validate_layout (layout/) refuses, with the user's numbers, every layout whose weight
  // degree does not divide these; reaching here with one is a bug.
  const int64_t n_kv = c.num_key_value_heads;
  FP_CHECK(D > 0 && c.num_attention_heads % D == 0 && n_kv > 0 && (n_kv % D == 0 || D % n_kv == 0) &&
               c.intermediate_size % D == 0 && c.vocab_size % D == 0,
           "shard_dims: degree {} for n_h={} n_kv={} f={} V={} (validate_layout passes first)", D,
           c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size);
  ShardDims d;
  d.degree = D;
  d.h = c.hidden_size;
  d.d = c.head_dim();
  d.heads = c.num_attention_heads / D;
  d.kv_group = n_kv < D ? D / n_kv : 1;
  d.kv_heads = n_kv < D ? 1 : n_kv / D;
  d.q_rows = d.heads * d.d;
  d.kv_rows = d.kv_heads * d.d;
  d.f_rows = c.intermediate_size / D;
  d.v_rows = c.vocab_size / D;
  const int64_t E = c.moe.num_experts;
  const int X = expert_degree > 0 ? expert_degree : D;
  d.expert_degree = X;
  if (c.moe.enabled() && E % X == 0) {
    d.experts = E / X;
    d.expert_rows = c.moe.moe_intermediate_size;
  } else if (c.moe.enabled() && X % E == 0 && c.moe.moe_intermediate_size % (X / E) == 0) {
    d.experts = 1;
    d.expert_group = X / E;
    d.expert_rows = c.moe.moe_intermediate_size / d.expert_group;
  }
  return d;
}

AttnPieces attn_pieces(const ShardDims& d, const Tensor& p) {
  FP_CHECK(p.dim(0) == d.attn_rows() && p.dim(1) == d.h, "attention shard {}", p.describe());
  int64_t row = 0;
  auto take = [&](int64_t n) {
    Tensor t = p.narrow(row, row + n);
    row += n;
    return t;
  };
  AttnPieces a;
  a.wq = take(d.q_rows);
  a.wk = take(d.kv_rows);
  a.wv = take(d.kv_rows);
  a.wo_t = take(d.q_rows);
  return a;
}

MlpPieces mlp_pieces(const ShardDims& d, const Tensor& p) {
  FP_CHECK(p.dim(0) == d.mlp_rows() && p.dim(1) == d.h, "MLP shard {}", p.describe());
  return MlpPieces{p.narrow(0, d.f_rows), p.narrow(d.f_rows, 2 * d.f_rows), p.narrow(2 * d.f_rows, 3 * d.f_rows)};
}

namespace {

// A sparse layer's part on one rank: the router (and shared expert) whole, dims.experts experts.
MoeLayerWeights allocate_moe_shard(const LlamaConfig& c, const ShardDims& d, DType dtype, MemCategory category,
                                   int64_t sparse_index) {
  FP_CHECK(d.experts > 0, "MoE shard of E={} over {} ranks (validate_layout passes first)", c.moe.num_experts,
           d.degree);
  return allocate_moe_layer(c, dtype, category, sparse_index, d.experts, d.expert_rows);
}

// A stage's embedding: the first stage's, and the last's LM head when tied.
bool holds_embed(const StageLayers& s, bool tied) { return s.embed || (tied && s.head); }

}  // namespace

ShardedWeights ShardedWeights::allocate(const LlamaConfig& c, const ShardDims& d, int owner, DType dtype,
                                MemCategory category, const StageLayers& stage) {
  ShardedWeights w;
  w.dims = d;
  w.owner = owner;
  w.tied = c.tie_word_embeddings;
  w.moe_family = c.moe.family;
  auto make = [&](const Shape& shape, bool held) { return held ? Tensor::empty(shape, dtype, category) : Tensor(); };
  int64_t sparse = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const bool held = stage.holds_layer(l);
    const bool moe = c.moe.is_sparse_layer(l);
    w.attn.push_back(make({d.attn_rows(), d.h}, held));
    w.mlp.push_back(make({d.mlp_rows(), d.h}, held && !moe));
    w.moe.push_back(moe && held ? allocate_moe_shard(c, d, dtype, category, sparse) : MoeLayerWeights());
    if (moe) ++sparse;
    w.attn_norm.push_back(make({d.h}, held));
    w.mlp_norm.push_back(make({d.h}, held));
    if (c.qkv_bias) w.qkv_bias.push_back(make({c.q_dim() + 2 * c.kv_dim()}, held));
    if (c.o_bias) w.o_bias.push_back(make({d.h}, held));
    if (c.qk_norm) w.qk_norm.push_back(make({2, d.d}, held));
    if (c.mlp_bias) {
      w.mlp_bias.push_back(make({2 * c.intermediate_size}, held));
      w.down_bias.push_back(make({d.h}, held));
    }
  }
  w.final_norm = make({d.h}, stage.head);
  w.embed = make({d.v_rows, d.h}, holds_embed(stage, w.tied));
  w.lm_head = w.tied ? (stage.head ? w.embed : Tensor()) : make({d.v_rows, d.h}, stage.head);
  return w;
}

void ShardedWeights::for_each(const std::function<void(const std::string&, Tensor&, bool)>& fn) {
  auto each = [&](const std::string& name, Tensor& t, bool replicated) {
    if (t.defined()) fn(name, t, replicated);  // undefined: another pipeline stage's
  };
  for (size_t l = 0; l < attn.size(); ++l) {
    each(fmt::format("layers.{}.attn", l), attn[l], false);
    each(fmt::format("layers.{}.mlp", l), mlp[l], false);
    for_each_moe_shard(*this, l, fn);
  }
  each("embed", embed, false);
  if (!tied) each("lm_head", lm_head, false);
  for (size_t l = 0; l < attn.size(); ++l) {
    each(fmt::format("layers.{}.attn_norm", l), attn_norm[l], true);
    each(fmt::format("layers.{}.mlp_norm", l), mlp_norm[l], true);
    if (l < qkv_bias.size()) each(fmt::format("layers.{}.qkv_bias", l), qkv_bias[l], true);
    if (l < o_bias.size()) each(fmt::format("layers.{}.o_bias", l), o_bias[l], true);
    if (l < qk_norm.size()) each(fmt::format("layers.{}.qk_norm", l), qk_norm[l], true);
    if (l < mlp_bias.size()) each(fmt::format("layers.{}.mlp_bias", l), mlp_bias[l], true);
    if (l < down_bias.size()) each(fmt::format("layers.{}.down_bias", l), down_bias[l], true);
  }
  each("final_norm", final_norm, true);
}

// Host zeroing: set-up and assembly only (steps zero gradients with ShardedGrads::zero).
void ShardedWeights::zero() {
  for_each([](const std::string&, Tensor& t, bool) { t.zero(); });
}

ShardedGrads ShardedGrads::allocate(const LlamaConfig& c, const ShardDims& dims, int owner, MemCategory category,
                                   const StageLayers& stage) {
  const int64_t L = c.num_hidden_layers, h = dims.h;
  const bool tied = c.tie_word_embeddings;
  int64_t layers = 0;  // this stage's
  for (int64_t l = 0; l < L; ++l) layers += stage.holds_layer(l) ? 1 : 0;
  const int64_t vocab_tensors = (holds_embed(stage, tied) ? 1 : 0) + (!tied && stage.head ? 1 : 0);
  // The MoE tensors of the sparse layers, in the sharded region after each layer's MLP.
  const MoeConfig& mc = c.moe;
  const int64_t fs = mc.shared_expert_intermediate_size;
  const int64_t moe_layer_elems =
      mc.enabled() ? mc.num_experts * h + dims.experts * 3 * dims.expert_rows * h + (fs > 0 ? 3 * fs * h + h : 0) : 0;
  int64_t moe_elems = 0, dense_layers = 0;
  for (int64_t l = 0; l < L; ++l) {
    if (!stage.holds_layer(l)) continue;
    if (mc.is_sparse_layer(l)) moe_elems += moe_layer_elems;
    else ++dense_layers;
  }
  // The replicated attention variants (qwen2 / attention_bias biases, qwen3 q/k norms) of each
  // held layer, between the sharded region and the norm gains (which stay contiguous: Megatron
  // sums them over tp on their own).
  const int64_t variant_elems = (c.qkv_bias ? c.q_dim() + 2 * c.kv_dim() : 0) + (c.o_bias ? h : 0) +
                                (c.qk_norm ? 2 * dims.d : 0) + (c.mlp_bias ? 2 * c.intermediate_size + h : 0);
  const int64_t total = layers * dims.attn_elems() + dense_layers * dims.mlp_elems() + moe_elems +
                        vocab_tensors * dims.vocab_elems() + layers * variant_elems +
                        (2 * layers + (stage.head ? 1 : 0)) * h;
  ShardedGrads g;
  g.flat_ = Tensor::zeros({total}, DType::kF32, category);  // storage-less: no fill (a dry run)
  g.known_zero_ = true;
  int64_t offset = 0;
  auto take = [&](const Shape& shape, bool held) {
    if (!held) return Tensor();
    Tensor t = g.flat_.narrow(offset, offset + shape.numel()).reshape(shape);
    offset += shape.numel();
    return t;
  };
  // ShardedWeights::for_each's order: the sharded tensors, then the gains, contiguous.
  ShardedWeights& w = g.views_;
  w.dims = dims;
  w.owner = owner;
  w.tied = tied;
  w.moe_family = c.moe.family;
  for (int64_t l = 0; l < L; ++l) {
    w.attn.push_back(take({dims.attn_rows(), h}, stage.holds_layer(l)));
    w.mlp.push_back(take({dims.mlp_rows(), h}, stage.holds_layer(l) && !c.moe.is_sparse_layer(l)));
    MoeLayerWeights m;
    if (stage.holds_layer(l) && mc.is_sparse_layer(l)) {
      auto expert = [&](int64_t f) { return ExpertWeights{take({f, h}, true), take({f, h}, true), take({h, f}, true)}; };
      m.router = take({mc.num_experts, h}, true);
      const int64_t experts_begin = offset;
      for (int64_t e = 0; e < dims.experts; ++e) m.experts.push_back(expert(dims.expert_rows));
      g.expert_regions_.emplace_back(experts_begin, offset);
      // The same layout as the weights' block (moe_weights.h): the expert ring's gradient lands here.
      if (dims.experts > 0)
        m.expert_block = g.flat_.narrow(experts_begin, offset).reshape({dims.experts * 3 * dims.expert_rows, h});
      if (fs > 0) {
        m.shared = expert(fs);
        m.shared_gate = take({1, h}, true);
      }
    }
    w.moe.push_back(std::move(m));
  }
  w.embed = take({dims.v_rows, h}, holds_embed(stage, tied));
  w.lm_head = tied ? (stage.head ? w.embed : Tensor()) : take({dims.v_rows, h}, stage.head);
  for (int64_t l = 0; l < L; ++l) {
    const bool held = stage.holds_layer(l);
    if (c.qkv_bias) w.qkv_bias.push_back(take({c.q_dim() + 2 * c.kv_dim()}, held));
    if (c.o_bias) w.o_bias.push_back(take({h}, held));
    if (c.qk_norm) w.qk_norm.push_back(take({2, dims.d}, held));
    if (c.mlp_bias) {
      w.mlp_bias.push_back(take({2 * c.intermediate_size}, held));
      w.down_bias.push_back(take({h}, held));
    }
  }
  g.norm_offset_ = offset;
  for (int64_t l = 0; l < L; ++l) {
    w.attn_norm.push_back(take({h}, stage.holds_layer(l)));
    w.mlp_norm.push_back(take({h}, stage.holds_layer(l)));
  }
  w.final_norm = take({h}, stage.head);
  FP_CHECK(offset == total, "flat sharded gradients: {} of {} elements laid out", offset, total);
  return g;
}

void ShardedGrads::zero(Backend& be) {
  be.fill(0.0, flat_);
  known_zero_ = true;
}

void sum_norm_partials(Backend& be, const std::vector<Tensor>& partials, ShardedWeights& grads,
                       const std::function<void(Tensor& packed)>& reduce) {
  const int64_t L = static_cast<int64_t>(grads.attn_norm.size()), n = static_cast<int64_t>(partials.size());
  FP_CHECK(n == 2 * L + 1, "{} norm partials for {} layers", n, L);
  auto dst = [&](int64_t i) -> Tensor& {
    return i < L ? grads.attn_norm[i] : (i < 2 * L ? grads.mlp_norm[i - L] : grads.final_norm);
  };
  std::vector<int64_t> held;  // the gains this rank holds (all but other pipeline stages')
  for (int64_t i = 0; i < n; ++i)
    if (dst(i).defined()) held.push_back(i);
  const int64_t k = static_cast<int64_t>(held.size());
  Tensor packed = Tensor::empty({k, grads.dims.h}, DType::kF32, MemCategory::kComm);
  for (int64_t j = 0; j < k; ++j) {
    Tensor row = packed.narrow(j, j + 1);
    be.copy(partials[static_cast<size_t>(held[j])], row);
  }
  reduce(packed);
  for (int64_t j = 0; j < k; ++j) be.add_inplace(packed.narrow(j, j + 1), dst(held[j]));
}

ShardedWeights allocate_variant_partials(Backend& be, const LlamaConfig& c, const ShardDims& d, bool with_o_bias) {
  ShardedWeights p;
  p.dims = d;
  auto zero = [&](const Shape& shape) {
    Tensor t = Tensor::empty(shape, DType::kF32, MemCategory::kGradients);
    be.fill(0.0, t);
    return t;
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.qkv_bias) p.qkv_bias.push_back(zero({c.q_dim() + 2 * c.kv_dim()}));
    if (c.o_bias && with_o_bias) p.o_bias.push_back(zero({d.h}));
    if (c.qk_norm) p.qk_norm.push_back(zero({2, d.d}));
    if (c.mlp_bias) p.mlp_bias.push_back(zero({2 * c.intermediate_size}));
    if (c.mlp_bias && with_o_bias) p.down_bias.push_back(zero({d.h}));
  }
  return p;
}

void sum_variant_partials(Backend& be, const ShardedWeights& partials, ShardedWeights& grads,
                          const std::function<void(Tensor& packed)>& reduce) {
  std::vector<std::pair<Tensor, Tensor>> pairs;  // (partial, gradient) of the layers this rank holds
  auto collect = [&](const std::vector<Tensor>& from, const std::vector<Tensor>& to) {
    for (size_t l = 0; l < from.size(); ++l)
      if (Tensor g = element_of(to, l); g.defined()) pairs.emplace_back(from[l], g);
  };
  collect(partials.qkv_bias, grads.qkv_bias);
  collect(partials.o_bias, grads.o_bias);
  collect(partials.qk_norm, grads.qk_norm);
  collect(partials.mlp_bias, grads.mlp_bias);
  collect(partials.down_bias, grads.down_bias);
  int64_t n = 0;
  for (const auto& [p, g] : pairs) n += p.numel();
  if (n == 0) return;
  Tensor packed = Tensor::empty({n}, DType::kF32, MemCategory::kComm);
  int64_t at = 0;
  for (const auto& [p, g] : pairs) {
    Tensor slot = packed.narrow(at, at + p.numel()).reshape(p.shape());
    be.copy(p, slot);
    at += p.numel();
  }
  reduce(packed);
  at = 0;
  for (auto& [p, g] : pairs) {
    be.add_inplace(packed.narrow(at, at + p.numel()).reshape(p.shape()), g);
    at += p.numel();
  }
}

void init_sharded_weights(const InitOptions& o, ShardedWeights& w) {
  const ShardDims& d = w.dims;
  const int r = w.owner;
  const int64_t h = d.h, q_cols = d.q_rows * d.degree, f = d.f_rows * d.degree;
  // Values made on the host, stored with one host copy per tensor.
  auto fill_rows = [&](Tensor t, const std::string& name, int64_t row0) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    const InitValues values(o, name);
    for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = static_cast<float>(values.at(row0 * h + i));
    write_host_f32(v, t);
  };
  auto fill_cols_t = [&](Tensor t, const std::string& name, int64_t col0, int64_t cols) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    const InitValues values(o, name);
    for_each_row_block(t.dim(0), h, [&](int64_t i, int64_t j) {
      v[static_cast<size_t>(i * h + j)] = static_cast<float>(values.at(j * cols + col0 + i));
    });
    write_host_f32(v, t);
  };
  for (size_t l = 0; l < w.attn.size(); ++l) {
    if (!w.attn[l].defined()) continue;  // another pipeline stage's layer
    const std::string pre = fmt::format("model.layers.{}.", l);
    AttnPieces a = attn_pieces(d, w.attn[l]);
    fill_rows(a.wq, pre + "self_attn.q_proj.weight", r * d.q_rows);
    fill_rows(a.wk, pre + "self_attn.k_proj.weight", d.kv_head0(r) * d.d);
    fill_rows(a.wv, pre + "self_attn.v_proj.weight", d.kv_head0(r) * d.d);
    fill_cols_t(a.wo_t, pre + "self_attn.o_proj.weight", r * d.q_rows, q_cols);
    if (w.mlp[l].defined()) {
      MlpPieces m = mlp_pieces(d, w.mlp[l]);
      fill_rows(m.w_gate, pre + "mlp.gate_proj.weight", r * d.f_rows);
      fill_rows(m.w_up, pre + "mlp.up_proj.weight", r * d.f_rows);
      fill_cols_t(m.w_down_t, pre + "mlp.down_proj.weight", r * d.f_rows, f);
    }
    for_each_moe_slice(w, l, [&](const GlobalSlice& at, Tensor& t, bool) {
      // Element (i, j) of the slice is global (row0 + i, col0 + j) of a [*, global_cols] tensor.
      const int64_t global_cols = is_expert_down_projection(at.tensor) ? d.expert_rows * d.expert_group : at.cols;
      std::vector<float> v(static_cast<size_t>(t.numel()));
      const InitValues values(o, at.tensor);
      for (int64_t i = 0; i < at.rows; ++i)
        for (int64_t j = 0; j < at.cols; ++j)
          v[static_cast<size_t>(i * at.cols + j)] =
              static_cast<float>(values.at((at.row0 + i) * global_cols + at.col0 + j));
      write_host_f32(v, t);
    });
    fill_rows(w.attn_norm[l], pre + "input_layernorm.weight", 0);
    fill_rows(w.mlp_norm[l], pre + "post_attention_layernorm.weight", 0);
    auto fill_span = [&](Tensor t, const std::string& name, int64_t at) {
      std::vector<float> v(static_cast<size_t>(t.numel()));
      const InitValues values(o, name);
      for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = static_cast<float>(values.at(at + i));
      write_host_f32(v, t);
    };
    const int64_t q = d.q_rows * d.degree, kv = d.n_kv() * d.d;
    if (Tensor b = element_of(w.qkv_bias, l); b.defined()) {
      fill_span(b.narrow(0, q), pre + "self_attn.q_proj.bias", 0);
      fill_span(b.narrow(q, q + kv), pre + "self_attn.k_proj.bias", 0);
      fill_span(b.narrow(q + kv, q + 2 * kv), pre + "self_attn.v_proj.bias", 0);
    }
    if (Tensor b = element_of(w.o_bias, l); b.defined()) fill_span(b, pre + "self_attn.o_proj.bias", 0);
    if (Tensor n = element_of(w.qk_norm, l); n.defined()) {
      fill_span(n.narrow(0, 1), pre + "self_attn.q_norm.weight", 0);
      fill_span(n.narrow(1, 2), pre + "self_attn.k_norm.weight", 0);
    }
    if (Tensor b = element_of(w.mlp_bias, l); b.defined()) {
      fill_span(b.narrow(0, f), pre + "mlp.gate_proj.bias", 0);
      fill_span(b.narrow(f, 2 * f), pre + "mlp.up_proj.bias", 0);
    }
    if (Tensor b = element_of(w.down_bias, l); b.defined()) fill_span(b, pre + "mlp.down_proj.bias", 0);
  }
  if (w.final_norm.defined()) fill_rows(w.final_norm, "model.norm.weight", 0);
  if (w.embed.defined()) fill_rows(w.embed, "model.embed_tokens.weight", r * d.v_rows);
  if (!w.tied && w.lm_head.defined()) fill_rows(w.lm_head, "lm_head.weight", r * d.v_rows);
}

void shard_from_global(const LlamaWeights& global, ShardedWeights& shard) {
  move_shards(shard, const_cast<LlamaWeights&>(global), /*to_global=*/false, /*replicated=*/true);
}

void unshard_into_global(const ShardedWeights& shard, bool replicated, LlamaWeights& global) {
  move_shards(const_cast<ShardedWeights&>(shard), global, /*to_global=*/true, replicated);
}

Status assemble_global(const ShardedWeights& shard, Communicator& axis, LlamaWeights& global) {
  // Every element comes from exactly one rank (shards are disjoint, replicated tensors come
  // from rank 0), so a sum over the axis assembles them exactly.
  global.zero();
  unshard_into_global(shard, axis.rank() == 0, global);
  Status status;
  global.for_each([&](const std::string&, Tensor& t) {
    if (status.ok())
      status = axis.all_reduce(t.raw_data(), t.raw_data(), static_cast<size_t>(t.numel()), DType::kF32, ReduceOp::kSum);
  });
  return status;
}

Status sum_experts_across(Communicator* across, LlamaWeights& global) {
  if (across == nullptr || across->size() == 1) return Status();
  for (LayerWeights& layer : global.layers)
    for (ExpertWeights& e : layer.moe.experts)
      for (Tensor* t : {&e.w_gate, &e.w_up, &e.w_down})
        FP_RETURN_IF_ERROR(across->all_reduce(t->raw_data(), t->raw_data(), static_cast<size_t>(t->numel()),
                                              DType::kF32, ReduceOp::kSum));
  return Status();
}

namespace {

// Global 2-D view of the tensor called `name`: [rows, cols].
GlobalSlice whole(const std::string& name, const Tensor& t) {
  const int64_t cols = t.dim(-1);
  return GlobalSlice{name, 0, t.numel() / cols, 0, cols, false, 0};
}

}  // namespace

std::vector<ParamRef> sharded_param_refs(ShardedWeights& w, ShardedWeights& g, bool count_replicated,
                                         bool count_sharded) {
  const ShardDims& d = w.dims;
  const int r = w.owner;
  const int64_t h = d.h;
  std::vector<ParamRef> refs;
  for (size_t l = 0; l < w.attn.size(); ++l) {
    if (!w.attn[l].defined()) continue;  // another pipeline stage's layer
    const std::string pre = fmt::format("model.layers.{}.", l);
    const int64_t q = d.q_rows, kv = d.kv_rows, kv0 = d.kv_head0(r) * d.d;
    if (d.replicated_kv()) {
      // KV replicas: the wk/wv rows are a ParamRef of their own, counted (norms, checkpoints)
      // on the group's first rank only; the query and output rows stay this rank's alone.
      auto rows = [](const Tensor& t, int64_t a, int64_t b) { return t.narrow(a, b); };
      refs.push_back(ParamRef{fmt::format("layers.{}.attn", l), rows(w.attn[l], 0, q), rows(g.attn[l], 0, q), true,
                              count_sharded, {GlobalSlice{pre + "self_attn.q_proj.weight", r * q, q, 0, h, false, 0}}});
      refs.push_back(ParamRef{fmt::format("layers.{}.attn_kv", l), rows(w.attn[l], q, q + 2 * kv),
                              rows(g.attn[l], q, q + 2 * kv), true, count_sharded && r == d.kv_group_first(r),
                              {GlobalSlice{pre + "self_attn.k_proj.weight", kv0, kv, 0, h, false, 0},
                               GlobalSlice{pre + "self_attn.v_proj.weight", kv0, kv, 0, h, false, kv * h}}});
      refs.push_back(ParamRef{fmt::format("layers.{}.attn_o", l), rows(w.attn[l], q + 2 * kv, 2 * q + 2 * kv),
                              rows(g.attn[l], q + 2 * kv, 2 * q + 2 * kv), true, count_sharded,
                              {GlobalSlice{pre + "self_attn.o_proj.weight", 0, h, r * q, q, true, 0}}});
    } else {
      refs.push_back(ParamRef{
          fmt::format("layers.{}.attn", l), w.attn[l], g.attn[l], true, count_sharded,
          {GlobalSlice{pre + "self_attn.q_proj.weight", r * q, q, 0, h, false, 0},
           GlobalSlice{pre + "self_attn.k_proj.weight", kv0, kv, 0, h, false, q * h},
           GlobalSlice{pre + "self_attn.v_proj.weight", kv0, kv, 0, h, false, (q + kv) * h},
           GlobalSlice{pre + "self_attn.o_proj.weight", 0, h, r * q, q, true, (q + 2 * kv) * h}}});
    }
    const int64_t f = d.f_rows;
    if (!w.mlp[l].defined()) continue;  // a sparse layer: its MoE tensors follow below
    refs.push_back(ParamRef{fmt::format("layers.{}.mlp", l), w.mlp[l], g.mlp[l], true, count_sharded,
                            {GlobalSlice{pre + "mlp.gate_proj.weight", r * f, f, 0, h, false, 0},
                             GlobalSlice{pre + "mlp.up_proj.weight", r * f, f, 0, h, false, f * h},
                             GlobalSlice{pre + "mlp.down_proj.weight", 0, h, r * f, f, true, 2 * f * h}}});
  }
  for (size_t l = 0; l < w.moe.size(); ++l) {
    // Whole Hugging Face tensors: this rank's experts, and the replicated router and shared expert.
    std::vector<std::pair<std::string, Tensor>> grads;
    for_each_moe_shard(g, l, [&](const std::string& name, Tensor& t, bool) { grads.emplace_back(name, t); });
    size_t i = 0;
    for_each_moe_slice(w, l, [&](const GlobalSlice& at, Tensor& t, bool rep) {
      FP_CHECK(i < grads.size() && grads[i].first == at.tensor, "MoE gradient for {}", at.tensor);
      // Experts spread wider than the weight axis (the Megatron baselines' tp x sp expert axis)
    // are this rank's own, whichever replica of the weight slices it is: counted here.
    const bool count_experts = d.expert_degree > d.degree || count_sharded;
    refs.push_back(ParamRef{at.tensor, t, grads[i++].second, true, rep ? count_replicated : count_experts, {at}, !rep});
    });
  }
  if (w.embed.defined())
    refs.push_back(ParamRef{"embed", w.embed, g.embed, true, count_sharded,
                            {GlobalSlice{"model.embed_tokens.weight", r * d.v_rows, d.v_rows, 0, h, false, 0}}});
  if (!w.tied && w.lm_head.defined())
    refs.push_back(ParamRef{"lm_head", w.lm_head, g.lm_head, true, count_sharded,
                            {GlobalSlice{"lm_head.weight", r * d.v_rows, d.v_rows, 0, h, false, 0}}});
  for (size_t l = 0; l < w.attn.size(); ++l) {
    if (!w.attn_norm[l].defined()) continue;
    const std::string pre = fmt::format("model.layers.{}.", l);
    refs.push_back(ParamRef{fmt::format("layers.{}.attn_norm", l), w.attn_norm[l], g.attn_norm[l], false,
                            count_replicated, {whole(pre + "input_layernorm.weight", w.attn_norm[l])}});
    refs.push_back(ParamRef{fmt::format("layers.{}.mlp_norm", l), w.mlp_norm[l], g.mlp_norm[l], false,
                            count_replicated, {whole(pre + "post_attention_layernorm.weight", w.mlp_norm[l])}});
    if (Tensor b = element_of(w.qkv_bias, l); b.defined()) {
      const int64_t q = d.q_rows * d.degree, kv = d.n_kv() * d.d;
      refs.push_back(ParamRef{fmt::format("layers.{}.qkv_bias", l), b, element_of(g.qkv_bias, l), false,
                              count_replicated,
                              {GlobalSlice{pre + "self_attn.q_proj.bias", 0, 1, 0, q, false, 0},
                               GlobalSlice{pre + "self_attn.k_proj.bias", 0, 1, 0, kv, false, q},
                               GlobalSlice{pre + "self_attn.v_proj.bias", 0, 1, 0, kv, false, q + kv}}});
    }
    if (Tensor b = element_of(w.o_bias, l); b.defined())
      refs.push_back(ParamRef{fmt::format("layers.{}.o_bias", l), b, element_of(g.o_bias, l), false,
                              count_replicated, {whole(pre + "self_attn.o_proj.bias", b)}});
    if (Tensor n = element_of(w.qk_norm, l); n.defined())
      refs.push_back(ParamRef{fmt::format("layers.{}.qk_norm", l), n, element_of(g.qk_norm, l), false,
                              count_replicated,
                              {GlobalSlice{pre + "self_attn.q_norm.weight", 0, 1, 0, d.d, false, 0},
                               GlobalSlice{pre + "self_attn.k_norm.weight", 0, 1, 0, d.d, false, d.d}}});
    if (Tensor b = element_of(w.mlp_bias, l); b.defined()) {
      const int64_t f = d.f_rows * d.degree;
      refs.push_back(ParamRef{fmt::format("layers.{}.mlp_bias", l), b, element_of(g.mlp_bias, l), false,
                              count_replicated,
                              {GlobalSlice{pre + "mlp.gate_proj.bias", 0, 1, 0, f, false, 0},
                               GlobalSlice{pre + "mlp.up_proj.bias", 0, 1, 0, f, false, f}}});
    }
    if (Tensor b = element_of(w.down_bias, l); b.defined())
      refs.push_back(ParamRef{fmt::format("layers.{}.down_bias", l), b, element_of(g.down_bias, l), false,
                              count_replicated, {whole(pre + "mlp.down_proj.bias", b)}});
  }
  if (w.final_norm.defined())
    refs.push_back(ParamRef{"final_norm", w.final_norm, g.final_norm, false, count_replicated,
                            {whole("model.norm.weight", w.final_norm)}});
  return refs;
}

void attach_attn_variants(const ShardedWeights& s, int l, int64_t q_head0, int64_t n_q, int64_t kv_head0,
                          int64_t n_kv, QkvWeights& w) {
  const ShardDims& d = s.dims;
  const size_t i = static_cast<size_t>(l);
  if (Tensor b = element_of(s.qkv_bias, i); b.defined()) {
    const int64_t q = d.q_rows * d.degree, kv = d.n_kv() * d.d;
    w.bq = b.narrow(q_head0 * d.d, (q_head0 + n_q) * d.d);
    w.bk = b.narrow(q + kv_head0 * d.d, q + (kv_head0 + n_kv) * d.d);
    w.bv = b.narrow(q + kv + kv_head0 * d.d, q + kv + (kv_head0 + n_kv) * d.d);
  }
  if (Tensor n = element_of(s.qk_norm, i); n.defined()) {
    w.q_norm = n.narrow(0, 1).reshape({d.d});
    w.k_norm = n.narrow(1, 2).reshape({d.d});
  }
}

void attach_mlp_bias(const ShardedWeights& s, int l, int64_t col0, int64_t cols, MlpWeights& w) {
  const Tensor b = element_of(s.mlp_bias, static_cast<size_t>(l));
  if (!b.defined()) return;
  const int64_t f = b.numel() / 2;
  w.b_gate = b.narrow(col0, col0 + cols);
  w.b_up = b.narrow(f + col0, f + col0 + cols);
}

Tensor kv_replica_rows(const ShardDims& d, const Tensor& packed_attn) {
  FP_CHECK(packed_attn.dim(0) == d.attn_rows(), "attention shard {}", packed_attn.describe());
  return packed_attn.narrow(d.q_rows, d.q_rows + 2 * d.kv_rows);
}

Status copy_kv_replica(Communicator& axis, const ShardDims& d, int source, Tensor& rows) {
  const int p = axis.rank(), first = d.kv_group_first(p), last = d.kv_group_last(p);
  FP_CHECK(source >= first && source <= last, "KV replica source {} outside rank {}'s group [{}, {}]", source, p, first,
           last);
  const size_t n = static_cast<size_t>(rows.numel());
  if (p != source) return axis.recv(rows.raw_data(), n, rows.dtype(), source);
  for (int r = first; r <= last; ++r)
    if (r != source) FP_RETURN_IF_ERROR(axis.send(rows.raw_data(), n, rows.dtype(), r));
  return Status();
}

Status sum_kv_replicas(Backend& be, Communicator& axis, const ShardDims& d, Tensor& rows) {
  const int p = axis.rank(), first = d.kv_group_first(p), last = d.kv_group_last(p);
  const size_t n = static_cast<size_t>(rows.numel());
  if (p != first) {
    FP_RETURN_IF_ERROR(axis.send(rows.raw_data(), n, rows.dtype(), first));
  } else {
    Tensor got = Tensor::empty(rows.shape(), rows.dtype(), MemCategory::kComm);
    for (int r = first + 1; r <= last; ++r) {
      FP_RETURN_IF_ERROR(axis.recv(got.raw_data(), n, rows.dtype(), r));
      be.add_inplace(got, rows);
    }
  }
  return copy_kv_replica(axis, d, first, rows);
}

std::vector<ParamRef> sharded_weight_refs(ShardedWeights& w, bool count_replicated) {
  std::vector<ParamRef> refs = sharded_param_refs(w, w, count_replicated);
  for (ParamRef& r : refs) r.grad = Tensor();
  return refs;
}

std::vector<ParamRef> replicated_param_refs(LlamaWeights& w, LlamaWeights& g, bool counted) {
  std::vector<ParamRef> refs;
  std::vector<Tensor> grads;
  g.for_each([&](const std::string&, Tensor& t) { grads.push_back(t); });
  size_t i = 0;
  w.for_each([&](const std::string& name, Tensor& t) {
    const bool norm = name.ends_with("norm.weight");
    refs.push_back(ParamRef{name, t, grads[i++], !norm && !name.ends_with(".bias"), counted, {whole(name, t)}});
  });
  return refs;
}

}  // namespace foldpar
