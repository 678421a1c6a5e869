// TSP with mixture-of-experts layers against the single-rank MoE model: loss (with the aux
// loss), this rank's logits rows and every gradient assembled from the shards, within
// kF32Parallel, for each dispatch scheme (a2a, gather, ring, auto), Mixtral-, Qwen2-MoE- (shared expert,
// a dense layer among the sparse ones) and Qwen3-MoE-like (decoder_sparse_step) configs,
// both aux-loss modes, recompute, and a zero router (ties to the lower index send every
// token to experts 0 and 1, so the ranks owning experts 2 and 3 receive no rows at all and
// still take part). Under dp=R and dp=R,tsp=D (2 and 4 ranks) the same model through
// make_sharded_model and the trainer's gradient sum over dp, against the single-rank model on
// the global batch. In bf16 storage (tsp=D and dp=R,tsp=D) against the single-rank model in
// bf16 and f32 within the bf16 rules below. Gradient accumulation (micro-batches) on one
// rank, tsp=D and dp=2 against the single-rank model micro-batch by micro-batch. Run under mpirun at 1, 2 and 4 ranks (E = 4
// divides over them).
#include <gtest/gtest.h>

#include <optional>

#include "app/synthetic.h"
#include "backend/bf16_storage_backend.h"
#include "comm/comm_stats.h"
#include "core/tolerance.h"
#include "comm/mesh.h"
#include "comm/self_communicator.h"
#include "model/moe_weights.h"
#include "moe_bf16_rules.h"
#include "moe_checks.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"
#include "parallel/tsp/tsp_model.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

LlamaConfig moe_config(MoeFamily family) {
  LlamaConfig c;
  c.hidden_size = 32;  // d = 8
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.vocab_size = 64;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = 1e-5;
  MoeConfig& m = c.moe;
  m.family = family;
  m.num_experts = 4;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = family == MoeFamily::kMixtral ? c.intermediate_size : 12;
  m.norm_topk_prob = family != MoeFamily::kQwen2;
  m.router_aux_loss_coef = 0.25;  // large, so that the aux gradient shows in every comparison
  m.output_router_logits = true;
  if (family == MoeFamily::kQwen2) {
    c.num_hidden_layers = 3;
    m.shared_expert_intermediate_size = 16;
    m.mlp_only_layers = {2};  // layers 0 and 1 sparse, 2 dense (TSP's MLP ring)
  }
  if (family == MoeFamily::kQwen3) {
    c.num_hidden_layers = 3;
    m.decoder_sparse_step = 2;  // only layer 1 sparse
  }
  return c;
}

struct Case {
  MoeFamily family = MoeFamily::kMixtral;
  Layout::MoeDispatchOption dispatch = Layout::MoeDispatchOption::kAllToAll;
  bool per_layer = false;
  bool zero_router = false;
  Recompute recompute = Recompute::kNone;
  bool swap_experts = false;  // negative control: each rank's first two experts trade places
  int64_t expert_width = 0;   // f_e instead of the config's (0: keep)
  int64_t experts = 0;        // E instead of the config's 4 (0: keep); E < D splits each expert over D/E ranks
  int64_t top_k = 0;          // k instead of the config's 2 (0: keep)
  // Negative control with split experts (D > E): each rank's down projection is its group
  // partner's f_e slice (rank p ^ 1), misaligned with its own gate and up rows.
  bool misalign_slice = false;
  int64_t kv_heads = 0;  // > 0: num_key_value_heads (fewer than D: KV replicas)
  // Each expert's weights and gradients in storage of their own, not views into the layer's
  // expert block: the ring packs a block of copies (its path for experts made apart).
  bool experts_apart = false;
  double capacity_factor = 0;  // > 0: moe_capacity_factor, in the reference and on the axis
};

const InitOptions kInit{.seed = 5, .std = 0.1, .norm_jitter = 0.2};

void check_parity(const Case& k) {
  Communicator& world = test::mpi().world();
  const int D = world.size(), p = world.rank();
  LlamaConfig c = moe_config(k.family);
  c.moe.aux_per_layer = k.per_layer;
  if (k.expert_width > 0) c.moe.moe_intermediate_size = k.expert_width;
  if (k.experts > 0) c.moe.num_experts = k.experts;
  if (k.top_k > 0) c.moe.num_experts_per_tok = k.top_k;
  if (k.kv_heads > 0) c.num_key_value_heads = k.kv_heads;
  c.moe.capacity_factor = k.capacity_factor;
  const int64_t B = 2, S = 16;

  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  if (k.zero_router)
    for (auto& l : w.layers)
      if (l.moe.defined()) l.moe.router.zero();
  Batch global = synthetic_batch(c, B, S, 13, 0.1);
  auto be = make_cpu_backend();
  LlamaWeights ref_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  StepOptions so;
  so.keep_logits = true;
  Result<StepResult> ref = model_forward_backward(c, *be, w, global, so, ref_g);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  ASSERT_GT(ref->aux_loss, 0.0);

  Layout opt;
  opt.tsp = D;
  opt.keep_logits = true;
  opt.moe_dispatch = k.dispatch;
  opt.recompute = k.recompute;
  Result<TspModel> model = TspModel::create(c, opt, p, S);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ShardedWeights tw = ShardedWeights::allocate(c, model->dims(), p, DType::kF32, MemCategory::kParameters);
  init_sharded_weights(kInit, tw);
  for (auto& m : tw.moe)
    if (m.defined() && k.zero_router) m.router.zero();
  if (k.swap_experts)
    for (auto& m : tw.moe)
      if (m.defined()) std::swap(m.experts[0], m.experts[1]);
  if (k.misalign_slice) {
    ASSERT_GT(model->dims().expert_group, 1) << "a misaligned slice needs experts split over ranks";
    ShardedWeights partner = ShardedWeights::allocate(c, model->dims(), p ^ 1, DType::kF32, MemCategory::kWorkspace);
    init_sharded_weights(kInit, partner);
    for (size_t l = 0; l < tw.moe.size(); ++l)
      if (tw.moe[l].defined()) tw.moe[l].experts[0].w_down.copy_from(partner.moe[l].experts[0].w_down);
  }
  ShardedWeights tg = ShardedWeights::allocate(c, model->dims(), p, DType::kF32, MemCategory::kGradients);
  tg.zero();
  if (k.experts_apart) {
    for (auto* ws : {&tw, &tg})
      for (auto& m : ws->moe) {
        if (!m.defined()) continue;
        ASSERT_TRUE(experts_are_block_views(m));
        for (auto& e : m.experts)
          for (Tensor* t : {&e.w_gate, &e.w_up, &e.w_down}) *t = t->clone(MemCategory::kParameters);
        ASSERT_FALSE(experts_are_block_views(m));
      }
  }
  const Batch local = model->shard().local_batch(global);
  Result<StepResult> got = model->forward_backward(*be, world, tw, local, tg);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  if (k.swap_experts || k.misalign_slice) {
    // An off-by-one expert id, or a down slice that is not its gate/up rows' partner, must
    // fail the comparison this test makes.
    EXPECT_GT(std::abs(got->loss - ref->loss), 10 * tol::kF32Parallel * ref->loss);
    return;
  }

  EXPECT_EQ(got->valid_tokens, ref->valid_tokens);
  EXPECT_NEAR(got->loss, ref->loss, tol::kF32Parallel * ref->loss);
  EXPECT_NEAR(got->aux_loss, ref->aux_loss, tol::kF32Parallel * ref->aux_loss);
  EXPECT_EQ(got->expert_load, ref->expert_load);
  if (k.zero_router) {
    // Every choice went to experts 0 .. k-1: the owners of the others got nothing.
    ASSERT_EQ(static_cast<int64_t>(ref->expert_load.size()), c.moe.num_experts);
    int64_t rest = 0;
    for (int64_t e = c.moe.num_experts_per_tok; e < c.moe.num_experts; ++e) rest += ref->expert_load[e];
    EXPECT_EQ(rest, 0);
  }
  Tensor ref_rows = Tensor::empty(got->logits.shape(), DType::kF32, MemCategory::kWorkspace);
  const std::vector<int32_t>& pos = model->shard().positions();
  for (int64_t b = 0; b < B; ++b)
    for (size_t i = 0; i < pos.size(); ++i)
      std::copy_n(ref->logits.data<float>() + (b * S + pos[i]) * c.vocab_size, c.vocab_size,
                  ref_rows.data<float>() + (b * static_cast<int64_t>(pos.size()) + static_cast<int64_t>(i)) * c.vocab_size);
  EXPECT_LE(max_rel_error(got->logits, ref_rows), tol::kF32Parallel) << "logits of rank " << p;

  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(assemble_global(tg, world, assembled).ok());
  std::vector<std::pair<std::string, Tensor>> ref_list;
  ref_g.for_each([&](const std::string& n, Tensor& t) { ref_list.emplace_back(n, t); });
  size_t i = 0, moe_tensors = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    ASSERT_EQ(name, ref_list[i].first);
    if (name.find("expert") != std::string::npos || name.find(".gate.weight") != std::string::npos) ++moe_tensors;
    const double err = max_rel_error(t, ref_list[i].second);
    EXPECT_LE(err, tol::kF32Parallel) << name << " on rank " << p << "\n"
                                      << describe_mismatches(t, ref_list[i].second, tol::kF32Parallel);
    ++i;
  });
  EXPECT_GT(moe_tensors, 0u);
  // The shards initialized on their own equal the slices of the global weights.
  ShardedWeights sliced = ShardedWeights::allocate(c, model->dims(), p, DType::kF32, MemCategory::kWorkspace);
  shard_from_global(w, sliced);
  std::vector<Tensor> own;
  tw.for_each([&](const std::string&, Tensor& t, bool) { own.push_back(t); });
  size_t j = 0;
  sliced.for_each([&](const std::string& name, Tensor& t, bool) { EXPECT_EQ(max_rel_error(own[j++], t), 0.0) << name; });
  EXPECT_EQ(j, own.size());
  if (model->dims().replicated_kv()) {
    // KV replicas: every member of a group holds its wk/wv gradient rows bit for bit, and they
    // equal the reference rows of the group's KV head (assemble_global reads the first only).
    const ShardDims& dm = model->dims();
    for (size_t l = 0; l < tg.attn.size(); ++l) {
      const Tensor rows = kv_replica_rows(dm, tg.attn[l]);
      const int64_t r0 = dm.kv_head0(p) * dm.d;
      EXPECT_LE(max_rel_error(rows.narrow(0, dm.kv_rows), ref_g.layers[l].wk.narrow(r0, r0 + dm.kv_rows)),
                tol::kF32Parallel)
          << "wk replica, layer " << l << ", rank " << p;
      Tensor all = Tensor::empty({D, rows.numel()}, DType::kF32, MemCategory::kWorkspace);
      ASSERT_TRUE(world.all_gather(rows.raw_data(), all.raw_data(), static_cast<size_t>(rows.numel()), DType::kF32).ok());
      const int first = dm.kv_group_first(p);
      EXPECT_EQ(max_rel_error(all.narrow(p, p + 1), all.narrow(first, first + 1)), 0.0) << "layer " << l << " rank " << p;
    }
  }
}

constexpr auto kA2A = Layout::MoeDispatchOption::kAllToAll;
constexpr auto kGather = Layout::MoeDispatchOption::kGather;
constexpr auto kRing = Layout::MoeDispatchOption::kRing;

TEST(TspMoeParity, MixtralAllToAll) { check_parity(Case{MoeFamily::kMixtral, kA2A}); }
TEST(TspMoeParity, MixtralGather) { check_parity(Case{MoeFamily::kMixtral, kGather}); }
TEST(TspMoeParity, Qwen2SharedExpertAndDenseLayerAllToAll) { check_parity(Case{MoeFamily::kQwen2, kA2A}); }
TEST(TspMoeParity, Qwen2SharedExpertAndDenseLayerGather) { check_parity(Case{MoeFamily::kQwen2, kGather}); }
TEST(TspMoeParity, MixtralRing) { check_parity(Case{MoeFamily::kMixtral, kRing}); }
TEST(TspMoeParity, Qwen2SharedExpertAndDenseLayerRing) { check_parity(Case{MoeFamily::kQwen2, kRing}); }
TEST(TspMoeParity, CapacityDropsAsTheSingleRankModelEachScheme) {
  // ceil(0.5 * 16 * 2 / 4) = 4 of each sequence's 32 pairs per expert: many go, and which go
  // depends on the other ranks' earlier tokens (zigzag chunks), so each rank must see them.
  for (auto dispatch : {kA2A, kGather, kRing}) {
    SCOPED_TRACE(static_cast<int>(dispatch));
    Case k{MoeFamily::kMixtral, dispatch};
    k.capacity_factor = 0.5;
    check_parity(k);
    Case q{MoeFamily::kQwen2, dispatch};  // shared expert and a dense layer
    q.capacity_factor = 0.75;
    check_parity(q);
  }
}

TEST(TspMoeParity, MixtralRingWithExpertsMadeApart) {
  Case k{MoeFamily::kMixtral, kRing};
  k.experts_apart = true;
  check_parity(k);
}
// Fewer KV heads than ranks in a MoE model (one KV head: a replica on every rank), under each
// dispatch: the attention is TSP's, whose KV replicas the MoE layer does not touch.
TEST(TspMoeParity, OneKvHeadEachDispatch) {
  for (auto dispatch : {kA2A, kGather, kRing}) {
    Case k{MoeFamily::kMixtral, dispatch};
    k.kv_heads = 1;
    check_parity(k);
    k = Case{MoeFamily::kQwen2, dispatch};
    k.kv_heads = 1;
    k.recompute = Recompute::kBlock;
    check_parity(k);
  }
}

TEST(TspMoeParity, Qwen3SparseStepPerLayerAux) {
  check_parity(Case{MoeFamily::kQwen3, kA2A, /*per_layer=*/true});
  check_parity(Case{MoeFamily::kQwen3, kGather, /*per_layer=*/true});
  check_parity(Case{MoeFamily::kQwen3, kRing, /*per_layer=*/true});
}
TEST(TspMoeParity, RanksWithNoTokensForTheirExperts) {
  check_parity(Case{MoeFamily::kMixtral, kA2A, false, /*zero_router=*/true});
  check_parity(Case{MoeFamily::kQwen2, kGather, false, /*zero_router=*/true});
  check_parity(Case{MoeFamily::kMixtral, kRing, false, /*zero_router=*/true});
}
TEST(TspMoeParity, RecomputeBlocks) {
  check_parity(Case{MoeFamily::kQwen2, kA2A, false, false, Recompute::kBlock});
  check_parity(Case{MoeFamily::kMixtral, kRing, false, false, Recompute::kBlock});
}
TEST(TspMoeParity, Auto) {
  // T = 2*16/D local rows against 2.25 E f_e / k: 108 rows at f_e = 24 (a2a at D = 2 and 4,
  // D >= k), 9 rows at f_e = 2 (the ring at D = 1 and 2, a2a at D = 4).
  check_parity(Case{MoeFamily::kMixtral, Layout::MoeDispatchOption::kAuto});
  Case narrow{MoeFamily::kMixtral, Layout::MoeDispatchOption::kAuto};
  narrow.expert_width = 2;
  check_parity(narrow);
}

TEST(TspMoeParity, NegativeControlSwappedExperts) {
  if (test::mpi().world().size() > 2) GTEST_SKIP() << "one expert per rank: nothing to swap within a rank";
  check_parity(Case{MoeFamily::kMixtral, kA2A, false, false, Recompute::kNone, /*swap_experts=*/true});
  check_parity(Case{MoeFamily::kMixtral, kGather, false, false, Recompute::kNone, /*swap_experts=*/true});
  check_parity(Case{MoeFamily::kMixtral, kRing, false, false, Recompute::kNone, /*swap_experts=*/true});
}

// ---- D > E: each expert's f_e split over its D/E ranks (ShardDims::expert_group) ----
//
// E = 1 and 2 below D = 2 and 4: rank r holds slice r % (D/E) of expert r / (D/E); every
// scheme's partial outputs over the slices add up to the single-rank layer's. k = 1 routes
// (E = 2) or sends every token to its one expert (E = 1, where the router's gradient is
// exactly zero: the aux loss is constant); Qwen2-MoE's E = 2, k = 2 with its shared expert
// and a dense layer; E = 2 with a zero router (k = 1: every token to expert 0, so the ranks
// of expert 1 receive no rows at all and still take part).
TEST(TspMoeSplitExperts, EachSchemeAgainstTheSingleRankModel) {
  const int D = test::mpi().world().size();
  if (D == 1) GTEST_SKIP() << "D > E needs two ranks";
  for (int64_t E : {1, 2}) {
    if (E >= D) continue;
    for (Layout::MoeDispatchOption d : {kA2A, kGather, kRing}) {
      SCOPED_TRACE(testing::Message() << "E=" << E << " D=" << D << " moe=" << static_cast<int>(d));
      Case mixtral{MoeFamily::kMixtral, d};
      mixtral.experts = E;
      mixtral.top_k = 1;
      check_parity(mixtral);
      Case qwen2{MoeFamily::kQwen2, d};
      qwen2.experts = E;
      qwen2.top_k = E;
      check_parity(qwen2);
      Case qwen3{MoeFamily::kQwen3, d, /*per_layer=*/true};
      qwen3.experts = E;
      qwen3.top_k = 1;
      qwen3.recompute = Recompute::kBlock;
      check_parity(qwen3);
      if (E == 2) {
        Case idle{MoeFamily::kMixtral, d, false, /*zero_router=*/true};
        idle.experts = E;
        idle.top_k = 1;
        check_parity(idle);
        Case capped{MoeFamily::kMixtral, d};  // at most 4 of a sequence's 16 pairs per expert
        capped.experts = E;
        capped.top_k = 1;
        capped.capacity_factor = 0.5;
        check_parity(capped);
      }
    }
  }
}

TEST(TspMoeSplitExperts, NegativeControlMisalignedSlice) {
  const int D = test::mpi().world().size();
  if (D == 1) GTEST_SKIP() << "D > E needs two ranks";
  for (Layout::MoeDispatchOption d : {kA2A, kGather, kRing}) {
    Case k{MoeFamily::kMixtral, d};
    k.experts = D / 2;
    k.top_k = 1;
    k.misalign_slice = true;
    check_parity(k);
  }
}

// ---- dp=R and dp=R,tsp=D (make_sharded_model, as train builds them) ----
//
// The reference is the single-rank MoE model on the same global batch [B, S]. Each dp
// replica runs its B/R sequences with the trainer's normalizer (the global batch's valid
// targets); the routing statistics are summed over tsp and dp inside the step, so the aux
// loss, its gradient and the per-expert load are the global batch's. Then the trainer's
// sum_grads_over_data_axis: every gradient (experts, router, shared expert and its gate, the
// dense weights) must be the single-rank model's, the summed loss_sum over the global valid
// count its loss with the aux term, within kF32Parallel. A forward alone (validation) too.
struct DpCase {
  const char* layout;
  MoeFamily family = MoeFamily::kMixtral;
  bool per_layer = false;
  int64_t experts = 0;  // E instead of the config's 4 (0: keep); E < D splits each expert over D/E ranks
  int64_t top_k = 0;    // k instead of the config's 2 (0: keep)
  // Negative control (ep over dp): the routed experts' gradients summed over the whole dp
  // axis instead of over the replicas holding the same experts; some must then differ.
  bool experts_over_whole_dp = false;
  int64_t expert_width = 0;  // f_e instead of the config's (0: keep)
  // ep over dp: the scheme the step must have run over the expert group ("a2a", "gather",
  // "ring"), seen in its traffic; null: not checked.
  const char* runs = nullptr;
  double capacity_factor = 0;  // > 0: moe_capacity_factor, in the reference and on the layout
};

void check_data_parallel(const DpCase& k) {
  Communicator& world = test::mpi().world();
  const Layout lo = parse_layout(k.layout).value();
  if (lo.ranks() != world.size()) return;
  SCOPED_TRACE(k.layout);
  LlamaConfig c = moe_config(k.family);
  c.moe.aux_per_layer = k.per_layer;
  if (k.experts > 0) c.moe.num_experts = k.experts;
  if (k.top_k > 0) c.moe.num_experts_per_tok = k.top_k;
  if (k.expert_width > 0) c.moe.moe_intermediate_size = k.expert_width;
  c.moe.capacity_factor = k.capacity_factor;
  const int64_t B = 4, S = 16;  // B / dp sequences per replica

  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  Batch global = synthetic_batch(c, B, S, 13, 0.1);
  auto be = make_cpu_backend();
  LlamaWeights ref_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  Result<StepResult> ref = model_forward_backward(c, *be, w, global, StepOptions{}, ref_g);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  ASSERT_GT(ref->aux_loss, 0.0);

  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
  Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, S, lo);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  ShardedModel& model = **made;
  model.init_weights(kInit);
  model.zero_grads(*be);
  const int64_t rows = B / lo.dp, r0 = mesh->coord("dp") * rows;
  const Batch replica{global.input_ids.narrow(r0, r0 + rows), global.target_ids.narrow(r0, r0 + rows)};
  const Batch local = model.local_batch(replica);
  const int64_t normalizer = be->count_valid_targets(global.target_ids, kIgnoreIndex);
  const std::vector<const Communicator*> beside = model.communicators_beside_mesh();
  ASSERT_TRUE(k.runs == nullptr || !beside.empty()) << "the scheme is checked on an expert group's traffic";
  std::optional<ScopedCommCounter> group_traffic;
  if (k.runs != nullptr) group_traffic.emplace(*beside.front());  // the expert group, "ep"
  Result<StepResult> got = model.forward_backward(*be, local, normalizer);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  if (k.runs != nullptr) {
    // Each scheme's own calls on the group: the all-to-all's counts exchange (its rows go by
    // send and recv), the gather's all_gather, the ring's send_recv hops.
    const CommStats t = group_traffic->delta();
    const std::string runs = k.runs;
    EXPECT_EQ(t.op(CommOpKind::kAllToAll).calls > 0, runs == "a2a") << runs;
    EXPECT_EQ(t.op(CommOpKind::kAllGather).calls > 0, runs == "gather") << runs;
    EXPECT_EQ(t.op(CommOpKind::kSendRecv).calls > 0, runs == "ring") << runs;
  }
  std::vector<ParamRef> params = model.parameters();
  // The trainer's sum: the routed experts over the replicas holding them (ep over dp).
  sum_grads_over_data_axis(mesh->has_axis("dp") ? &mesh->comm("dp") : nullptr, params,
                           k.experts_over_whole_dp ? nullptr : model.expert_data_axis());

  // The trainer's loss: loss_sum summed over every rank, once per model replica's ranks.
  auto global_loss = [&](double loss_sum) {
    double sum = loss_sum;
    FP_CHECK_OK(world.all_reduce(&sum, &sum, 1, DType::kF64, ReduceOp::kSum));
    return sum / lo.model_ranks() / static_cast<double>(normalizer);
  };
  EXPECT_NEAR(global_loss(got->loss_sum), ref->loss, tol::kF32Parallel * ref->loss);
  EXPECT_NEAR(got->aux_loss, ref->aux_loss, tol::kF32Parallel * ref->aux_loss);
  EXPECT_EQ(got->expert_load, ref->expert_load);

  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(model.assemble_grads(assembled).ok());
  std::vector<std::pair<std::string, Tensor>> ref_list;
  ref_g.for_each([&](const std::string& n, Tensor& t) { ref_list.emplace_back(n, t); });
  if (k.experts_over_whole_dp) {
    test::expect_experts_off(assembled, ref_list);
    return;
  }
  // The weights assemble to the single-rank model's (every expert from its owner, over the
  // expert group's replicas too).
  LlamaWeights weights = LlamaWeights::allocate(c, DType::kF32, MemCategory::kWorkspace);
  ASSERT_TRUE(model.assemble_weights(weights).ok());
  test::expect_weights_exact(weights, w);
  size_t i = 0, routers = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    ASSERT_EQ(name, ref_list[i].first);
    if (name.find(".gate.weight") != std::string::npos) ++routers;
    EXPECT_LE(max_rel_error(t, ref_list[i].second), tol::kF32Parallel)
        << name << " on rank " << world.rank() << "\n"
        << describe_mismatches(t, ref_list[i].second, tol::kF32Parallel);
    ++i;
  });
  EXPECT_GT(routers, 0u);

  // A forward alone (the trainer's validation): the same loss.
  Result<StepResult> fwd = model.forward(*be, local);
  ASSERT_TRUE(fwd.ok()) << fwd.status().to_string();
  EXPECT_NEAR(global_loss(fwd->loss_sum), ref->loss, tol::kF32Parallel * ref->loss);
  EXPECT_EQ(fwd->expert_load, ref->expert_load);
}

// Each replica's sequences are its own: the capacity exchange runs over its tsp axis, also
// when the experts' group spans two replicas (ep = 2 D).
TEST(TspMoeDataParallel, CapacityDropsAsTheSingleRankModel) {
  for (const char* l : {"dp=2,tsp=1", "dp=2,tsp=2:moe=ring", "dp=2,tsp=1,ep=2", "dp=2,tsp=2,ep=4:moe=gather"}) {
    DpCase k{l};
    k.capacity_factor = 0.5;
    check_data_parallel(k);
  }
}

TEST(TspMoeDataParallel, EqualsTheSingleRankModelOnTheGlobalBatch) {
  const int W = test::mpi().world().size();
  if (W == 1) GTEST_SKIP() << "dp needs two ranks";
  for (const DpCase& k : {DpCase{"dp=2,tsp=1"}, DpCase{"dp=2,tsp=1", MoeFamily::kQwen2},
                          DpCase{"dp=4,tsp=1", MoeFamily::kQwen3, true}, DpCase{"dp=2,tsp=2:moe=a2a"},
                          DpCase{"dp=2,tsp=2:moe=gather", MoeFamily::kQwen2},
                          DpCase{"dp=2,tsp=2:moe=ring", MoeFamily::kQwen3, true}})
    check_data_parallel(k);
}

// Experts over dp replicas (ep=N = K D): each expert group spans K dp replicas, the dispatch
// (a2a or gather) over the group, the experts' gradients summed over the dp/K replicas holding them.
TEST(TspMoeDataParallel, ExpertsOverDataParallelReplicas) {
  const int W = test::mpi().world().size();
  if (W == 1) GTEST_SKIP() << "ep over dp needs two ranks";
  for (const DpCase& k : {DpCase{"dp=2,tsp=1,ep=2"}, DpCase{"dp=2,tsp=1,ep=2", MoeFamily::kQwen2},
                          DpCase{"dp=4,tsp=1,ep=4", MoeFamily::kMixtral}, DpCase{"dp=4,tsp=1,ep=2", MoeFamily::kQwen2},
                          DpCase{"dp=2,tsp=2,ep=4:moe=a2a"}, DpCase{"dp=2,tsp=2,ep=4", MoeFamily::kQwen3, true},
                          DpCase{"dp=2,tsp=1,ep=2:moe=gather", MoeFamily::kQwen2},
                          DpCase{"dp=2,tsp=2,ep=4:moe=gather", MoeFamily::kMixtral},
                          DpCase{"dp=4,tsp=2,ep=4:moe=a2a", MoeFamily::kQwen3}})
    check_data_parallel(k);
}
// moe=auto over an expert group (tsp_moe.cc moe_scheme): spec COMPOSITION.md 3's training
// rule over the group's X = ep ranks, T the rank's own rows (B/dp sequences of 16 over tsp):
// the ring iff T > 2.25 E f_e / k, else the gather iff X < k, else the all-to-all. E = 4, k = 2
// and f_e = 24 (108 rows): a2a at T = 32 and 16; f_e = 2 (9 rows): the ring; k = 4 at f_e =
// 24 (54 rows) over X = 2 < k: the gather. Each against the single-rank model.
TEST(TspMoeDataParallel, AutoOverAnExpertGroupTakesTheBytesRuleOverItsRanks) {
  const int W = test::mpi().world().size();
  if (W == 1) GTEST_SKIP() << "ep over dp needs two ranks";
  DpCase a2a{"dp=2,tsp=1,ep=2"}, ring{"dp=2,tsp=1,ep=2"}, gather{"dp=2,tsp=1,ep=2"};
  a2a.runs = "a2a";
  ring.expert_width = 2;
  ring.runs = "ring";
  gather.top_k = 4;
  gather.runs = "gather";
  DpCase ring4{"dp=2,tsp=2,ep=4", MoeFamily::kQwen3, true}, ring4dp{"dp=4,tsp=1,ep=2"}, a2a4{"dp=4,tsp=1,ep=4"};
  ring4.expert_width = 2;  // Qwen3's f_e = 12 else
  ring4.runs = "ring";
  ring4dp.expert_width = 2;
  ring4dp.runs = "ring";
  a2a4.runs = "a2a";
  for (const DpCase& k : {a2a, ring, gather, ring4, ring4dp, a2a4}) check_data_parallel(k);
}

// The expert-weight ring over the expert group's K D ranks: each rank's E/ep experts visit
// every rank of the group, each applies them to its own rows, and the gradient ring brings
// each block's sum over the K replicas home; dp=4,tsp=1,ep=2 leaves dp/K = 2 replicas per
// expert for the trainer's edp sum. dp=4,tsp=2,ep=4 runs at eight ranks (the ctest entry
// parallel.tsp_moe_parity_test.ep8.np8).
TEST(TspMoeDataParallel, ExpertRingOverDataParallelReplicas) {
  const int W = test::mpi().world().size();
  if (W == 1) GTEST_SKIP() << "ep over dp needs two ranks";
  for (const DpCase& k : {DpCase{"dp=2,tsp=1,ep=2:moe=ring"}, DpCase{"dp=2,tsp=2,ep=4:moe=ring", MoeFamily::kQwen2},
                          DpCase{"dp=4,tsp=1,ep=4:moe=ring", MoeFamily::kQwen3, true},
                          DpCase{"dp=4,tsp=1,ep=2:moe=ring", MoeFamily::kMixtral},
                          DpCase{"dp=4,tsp=2,ep=4:moe=ring", MoeFamily::kQwen2}})
    check_data_parallel(k);
}
TEST(TspMoeDataParallel, NegativeControlExpertGradientsOverTheWholeDataAxis) {
  const int W = test::mpi().world().size();
  if (W == 1) GTEST_SKIP() << "ep over dp needs two ranks";
  for (const char* text : {"dp=2,tsp=1,ep=2", "dp=4,tsp=1,ep=2", "dp=2,tsp=2,ep=4", "dp=4,tsp=1,ep=2:moe=ring",
                           "dp=2,tsp=2,ep=4:moe=ring"}) {
    DpCase k{text};
    k.experts_over_whole_dp = true;
    check_data_parallel(k);
  }
}

// dp with D > E: dp=2,tsp=2 over one expert (each replica's two ranks share its f_e) at four
// ranks, for each scheme; Qwen2-MoE's shared expert and dense layer with it.
TEST(TspMoeDataParallel, SplitExpertsEqualTheSingleRankModelOnTheGlobalBatch) {
  if (test::mpi().world().size() != 4) GTEST_SKIP() << "dp=2,tsp=2 runs at four ranks";
  for (const DpCase& k : {DpCase{"dp=2,tsp=2:moe=a2a", MoeFamily::kMixtral, false, 1, 1},
                          DpCase{"dp=2,tsp=2:moe=gather", MoeFamily::kQwen2, false, 1, 1},
                          DpCase{"dp=2,tsp=2:moe=ring", MoeFamily::kQwen3, true, 1, 1}})
    check_data_parallel(k);
}

// ---- gradient accumulation: micro-batches on one rank and tsp=D ----
//
// A micro-batches of the global batch, each with its own aux loss weighted by its share
// v_m / N of the step's valid targets (docs/design.md, "Mixture of experts"). The reference
// comes from the single-rank model as it always ran, micro-batch by micro-batch: the
// accumulated gradient is sum_m (v_m / N) x the gradient of micro-batch m's own mean loss
// (cross-entropy + coef aux_m), and the loss sum_m (v_m / N) loss_m. Without the aux term in
// the loss (output_router_logits false) the accumulated gradient is the one big batch's: the
// routing is dropless and per token, so each token meets the same experts either way.
// synthetic_batch ignores a tenth of the targets, so the v_m differ.
void check_accumulation(MoeFamily family, Layout::MoeDispatchOption dispatch, bool aux_in_loss) {
  Communicator& world = test::mpi().world();
  const int D = world.size();
  SCOPED_TRACE(testing::Message() << "D=" << D << " family " << static_cast<int>(family) << " moe "
                                  << static_cast<int>(dispatch) << (aux_in_loss ? " with" : " without")
                                  << " the aux term");
  LlamaConfig c = moe_config(family);
  c.moe.output_router_logits = aux_in_loss;
  const int64_t B = 4, S = 16;  // four micro-batches of one sequence
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  const Batch global = synthetic_batch(c, B, S, 13, 0.1);
  auto be = make_cpu_backend();
  const int64_t N = be->count_valid_targets(global.target_ids, kIgnoreIndex);
  std::vector<Batch> parts;
  for (int64_t m = 0; m < B; ++m)
    parts.push_back(Batch{global.input_ids.narrow(m, m + 1), global.target_ids.narrow(m, m + 1)});

  LlamaWeights ref_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  double ref_loss = 0, ref_aux = 0;
  if (aux_in_loss) {
    std::vector<Tensor> sum;
    ref_g.for_each([&](const std::string&, Tensor& t) { sum.push_back(t); });
    for (const Batch& part : parts) {
      LlamaWeights g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
      g.zero();
      Result<StepResult> r = model_forward_backward(c, *be, w, part, StepOptions{}, g);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      const double share = static_cast<double>(r->valid_tokens) / static_cast<double>(N);
      ref_loss += share * r->loss;
      ref_aux += share * r->aux_loss;
      size_t i = 0;
      g.for_each([&](const std::string&, Tensor& t) {
        for (int64_t j = 0; j < t.numel(); ++j)
          sum[i].data<float>()[j] += static_cast<float>(share * static_cast<double>(t.data<float>()[j]));
        ++i;
      });
    }
  } else {
    Result<StepResult> r = model_forward_backward(c, *be, w, global, StepOptions{}, ref_g);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ref_loss = r->loss;
  }

  Layout lo;
  lo.tsp = D;
  lo.moe_dispatch = dispatch;
  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
  Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, S, lo);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  ShardedModel& model = **made;
  model.init_weights(kInit);
  model.zero_grads(*be);
  std::vector<Batch> locals;
  for (const Batch& part : parts) locals.push_back(model.local_batch(part));
  Result<StepResult> got = model.forward_backward_micro_batches(*be, locals, N);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  // loss_sum is the axis's (every rank holds it): the trainer's loss is loss_sum / N.
  EXPECT_NEAR(got->loss_sum / static_cast<double>(N), ref_loss, tol::kF32Parallel * ref_loss);
  if (aux_in_loss) {
    EXPECT_NEAR(got->aux_loss, ref_aux, tol::kF32Parallel * ref_aux);
  }
  int64_t load = 0;
  for (int64_t n : got->expert_load) load += n;
  EXPECT_EQ(load, B * S * c.moe.num_experts_per_tok * c.moe.sparse_layer_count(c.num_hidden_layers));

  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(model.assemble_grads(assembled).ok());
  std::vector<std::pair<std::string, Tensor>> ref_list;
  ref_g.for_each([&](const std::string& n, Tensor& t) { ref_list.emplace_back(n, t); });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    ASSERT_EQ(name, ref_list[i].first);
    EXPECT_LE(max_rel_error(t, ref_list[i].second), tol::kF32Parallel)
        << name << " on rank " << world.rank() << "\n"
        << describe_mismatches(t, ref_list[i].second, tol::kF32Parallel);
    ++i;
  });
}

TEST(TspMoeAccumulation, WithoutTheAuxTermEqualsOneBigBatch) {
  check_accumulation(MoeFamily::kMixtral, kA2A, false);
  check_accumulation(MoeFamily::kQwen2, kRing, false);
}

TEST(TspMoeAccumulation, EachMicroBatchItsOwnAuxLossWeightedByItsValidTargets) {
  check_accumulation(MoeFamily::kMixtral, kA2A, true);
  check_accumulation(MoeFamily::kQwen2, kGather, true);
  check_accumulation(MoeFamily::kQwen3, kRing, true);
}

// Under dp=2 (dp=2,tsp=1 at two ranks, dp=2,tsp=2 at four) replica r holds rows [2r, 2r + 2)
// of the B = 4 sequences, one per micro-batch: micro-batch a of the step is rows {a, 2 + a},
// its routing statistics summed over both replicas. The reference: the single-rank model on
// those two rows, weighted by their share of the valid targets, summed over a; the trainer's
// gradient sum over dp and its loss (the replicas' loss_sum over the global count).
TEST(TspMoeAccumulation, UnderDataParallelismMicroBatchAIsEveryReplicasAth) {
  Communicator& world = test::mpi().world();
  if (world.size() == 1) GTEST_SKIP() << "dp needs two ranks";
  const Layout lo = parse_layout(world.size() == 2 ? "dp=2,tsp=1" : "dp=2,tsp=2:moe=a2a").value();
  const LlamaConfig c = moe_config(MoeFamily::kMixtral);
  const int64_t B = 4, S = 16, rows = 2;
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  const Batch global = synthetic_batch(c, B, S, 13, 0.1);
  auto be = make_cpu_backend();
  const int64_t N = be->count_valid_targets(global.target_ids, kIgnoreIndex);
  // Rows {a, 2 + a} of the global batch.
  auto pick = [&](const Tensor& t, int64_t a) {
    Tensor out = Tensor::empty({2, S}, DType::kI32, MemCategory::kWorkspace);
    for (int64_t i = 0; i < 2; ++i) std::copy_n(t.data<int32_t>() + (a + i * rows) * S, S, out.data<int32_t>() + i * S);
    return out;
  };
  LlamaWeights ref_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  std::vector<Tensor> sum;
  ref_g.for_each([&](const std::string&, Tensor& t) { sum.push_back(t); });
  double ref_loss = 0;
  for (int64_t a = 0; a < rows; ++a) {
    LlamaWeights g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
    g.zero();
    Result<StepResult> r =
        model_forward_backward(c, *be, w, Batch{pick(global.input_ids, a), pick(global.target_ids, a)}, StepOptions{}, g);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    const double share = static_cast<double>(r->valid_tokens) / static_cast<double>(N);
    ref_loss += share * r->loss;
    size_t i = 0;
    g.for_each([&](const std::string&, Tensor& t) {
      for (int64_t j = 0; j < t.numel(); ++j)
        sum[i].data<float>()[j] += static_cast<float>(share * static_cast<double>(t.data<float>()[j]));
      ++i;
    });
  }

  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
  Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, S, lo);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  ShardedModel& model = **made;
  model.init_weights(kInit);
  model.zero_grads(*be);
  const int64_t r0 = mesh->coord("dp") * rows;
  std::vector<Batch> locals;
  for (int64_t a = 0; a < rows; ++a)
    locals.push_back(model.local_batch(Batch{global.input_ids.narrow(r0 + a, r0 + a + 1),
                                             global.target_ids.narrow(r0 + a, r0 + a + 1)}));
  Result<StepResult> got = model.forward_backward_micro_batches(*be, locals, N);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  std::vector<ParamRef> params = model.parameters();
  sum_grads_over_data_axis(&mesh->comm("dp"), params);
  double loss_sum = got->loss_sum;
  FP_CHECK_OK(world.all_reduce(&loss_sum, &loss_sum, 1, DType::kF64, ReduceOp::kSum));
  EXPECT_NEAR(loss_sum / lo.model_ranks() / static_cast<double>(N), ref_loss, tol::kF32Parallel * ref_loss);
  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(model.assemble_grads(assembled).ok());
  std::vector<std::pair<std::string, Tensor>> ref_list;
  ref_g.for_each([&](const std::string& n, Tensor& t) { ref_list.emplace_back(n, t); });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    EXPECT_LE(max_rel_error(t, ref_list[i].second), tol::kF32Parallel)
        << name << " on rank " << world.rank() << "\n"
        << describe_mismatches(t, ref_list[i].second, tol::kF32Parallel);
    ++i;
  });
}

// ---- bf16 storage (:bf16) on one rank and on tsp=D ----
//
// The tolerances and the routing margin are moe_bf16_rules.h's (with their derivation): the
// loss within 1 bf16 ulp, logits and gradients within 16, the routers' within 32; the
// references are the single-rank model in bf16 and in f32.
using test::kBf16LossTol;
using test::kBf16RouterTol;
using test::kBf16TensorTol;

struct Bf16Run {
  Result<StepResult> step = StepResult();
  LlamaWeights grads;
};
// The single-rank model over `w` on `be`.
Bf16Run single_rank(const LlamaConfig& c, const LlamaWeights& w, Backend& be, const Batch& global) {
  Bf16Run out{StepResult(), LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients)};
  out.grads.zero();
  StepOptions so;
  so.keep_logits = true;
  out.step = model_forward_backward(c, be, w, global, so, out.grads);
  return out;
}

// layout: dp=R,tsp=D:bf16 (R = 1 included) over the whole world; skipped at another size.
// Under dp each replica runs its B/R sequences with the global normalizer and the trainer's
// gradient sum follows (sum_grads_over_data_axis), as in check_data_parallel.
void check_bf16_parity(const std::string& text, MoeFamily family) {
  Communicator& world = test::mpi().world();
  Layout lo = parse_layout(text).value();
  if (lo.ranks() != world.size()) return;
  SCOPED_TRACE(text);
  lo.keep_logits = true;
  const LlamaConfig c = moe_config(family);
  const int64_t B = 4, S = 16;
  const Batch global = synthetic_batch(c, B, S, 13, 0.1);
  auto cpu = make_cpu_backend();
  auto bf = make_bf16_storage_backend(*cpu);
  LlamaWeights w32 = test::moe_margin_weights(c, kInit);
  const LlamaWeights w16 = test::converted_weights(c, w32, DType::kBF16);
  const Bf16Run want = single_rank(c, w16, *bf, global), f32 = single_rank(c, w32, *cpu, global);
  ASSERT_TRUE(want.step.ok() && f32.step.ok()) << want.step.status().to_string() << f32.step.status().to_string();
  ASSERT_EQ(want.step->expert_load, f32.step->expert_load) << "the margin keeps bf16 and f32 routing alike";

  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
  Communicator& tsp = mesh->comm("tsp");
  Communicator* dp = mesh->has_axis("dp") ? &mesh->comm("dp") : nullptr;
  const int p = tsp.rank();
  Result<TspModel> model = TspModel::create(c, lo, p, S);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ShardedWeights tw = ShardedWeights::allocate(c, model->dims(), p, DType::kBF16, MemCategory::kParameters);
  shard_from_global(w32, tw);
  ShardedWeights tg = ShardedWeights::allocate(c, model->dims(), p, DType::kF32, MemCategory::kGradients);
  tg.zero();
  const int64_t rows = B / lo.dp, r0 = mesh->coord("dp") * rows;
  const Batch replica{global.input_ids.narrow(r0, r0 + rows), global.target_ids.narrow(r0, r0 + rows)};
  const int64_t normalizer = cpu->count_valid_targets(global.target_ids, kIgnoreIndex);
  Result<StepResult> got =
      model->forward_backward(*bf, tsp, tw, model->shard().local_batch(replica), tg, normalizer, dp);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  std::vector<ParamRef> refs = sharded_param_refs(tw, tg, p == 0);
  sum_grads_over_data_axis(dp, refs);
  EXPECT_EQ(got->expert_load, want.step->expert_load);
  // The global loss: the replicas' cross-entropy sums over the global count, plus the aux term.
  double ce = got->loss_sum;
  if (dp != nullptr) FP_CHECK_OK(dp->all_reduce(&ce, &ce, 1, DType::kF64, ReduceOp::kSum));
  const double loss = ce / static_cast<double>(normalizer) + c.moe.router_aux_loss_coef * got->aux_loss;
  for (const StepResult* ref : {&*want.step, &*f32.step}) {
    EXPECT_NEAR(loss, ref->loss, kBf16LossTol * ref->loss);
    EXPECT_NEAR(got->aux_loss, ref->aux_loss, kBf16LossTol * ref->aux_loss);
  }
  // This replica's rows of the logits.
  Tensor logits = Tensor::empty({rows, S, c.vocab_size}, DType::kF32, MemCategory::kWorkspace);
  ASSERT_TRUE(model->assemble_logits(tsp, got->logits.to(DType::kF32, MemCategory::kWorkspace), logits).ok());
  const Tensor want_rows = want.step->logits.narrow(r0, r0 + rows), f32_rows = f32.step->logits.narrow(r0, r0 + rows);
  EXPECT_LE(max_rel_error(logits, want_rows), kBf16TensorTol) << describe_mismatches(logits, want_rows, kBf16TensorTol);
  EXPECT_LE(max_rel_error(logits, f32_rows), kBf16TensorTol);
  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(assemble_global(tg, tsp, assembled).ok());
  std::vector<Tensor> want_g, f32_g;
  const_cast<LlamaWeights&>(want.grads).for_each([&](const std::string&, Tensor& t) { want_g.push_back(t); });
  const_cast<LlamaWeights&>(f32.grads).for_each([&](const std::string&, Tensor& t) { f32_g.push_back(t); });
  size_t i = 0;
  double worst = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    const double e = max_rel_error(t, want_g[i]), e32 = max_rel_error(t, f32_g[i]);
    const double tol = name.ends_with(".gate.weight") ? kBf16RouterTol : kBf16TensorTol;
    worst = std::max({worst, e, e32});
    EXPECT_LE(e, tol) << name << " on rank " << world.rank() << " against bf16\n"
                      << describe_mismatches(t, want_g[i], tol);
    EXPECT_LE(e32, tol) << name << " on rank " << world.rank() << " against f32\n"
                        << describe_mismatches(t, f32_g[i], tol);
    ++i;
  });
  EXPECT_EQ(i, want_g.size());
  if (world.rank() == 0)
    std::printf("%s: loss %.6f (bf16 %.6f, f32 %.6f), worst gradient error %.2e\n", text.c_str(), loss,
                want.step->loss, f32.step->loss, worst);
}

std::string tsp_of_world(const char* options) {
  return "tsp=" + std::to_string(test::mpi().world().size()) + options;
}

TEST(TspMoeBf16Parity, MixtralAllToAll) { check_bf16_parity(tsp_of_world(":bf16:moe=a2a"), MoeFamily::kMixtral); }
TEST(TspMoeBf16Parity, Qwen2SharedExpertGather) {
  check_bf16_parity(tsp_of_world(":bf16:moe=gather"), MoeFamily::kQwen2);
}
TEST(TspMoeBf16Parity, Qwen3Ring) { check_bf16_parity(tsp_of_world(":bf16:moe=ring"), MoeFamily::kQwen3); }
TEST(TspMoeBf16Parity, DataParallel) {
  if (test::mpi().world().size() == 1) GTEST_SKIP() << "dp needs two ranks";
  check_bf16_parity("dp=2,tsp=1:bf16", MoeFamily::kMixtral);
  check_bf16_parity("dp=2,tsp=2:bf16:moe=a2a", MoeFamily::kQwen2);
  check_bf16_parity("dp=4,tsp=1:bf16", MoeFamily::kQwen3);
}

// One rank through make_sharded_model (the single-rank model in bf16, as `train --bf16` builds
// it): bf16 parameters, f32 gradients, and the step of model_forward_backward in bf16.
TEST(TspMoeBf16Parity, OneRankIsTheSingleRankModelInBf16) {
  if (test::mpi().world().size() != 1) GTEST_SKIP() << "one rank";
  const LlamaConfig c = moe_config(MoeFamily::kQwen2);
  Layout lo = parse_layout("tsp=1:bf16").value();
  SelfCommunicator self("world", 0);
  Result<Mesh> mesh = Mesh::create(self, lo.mesh());
  ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
  Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(c, *mesh, 16, lo);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  (*m)->init_weights(kInit);
  (*m)->zero_grads(*make_cpu_backend());
  for (const ParamRef& p : (*m)->parameters()) {
    EXPECT_EQ(p.param.dtype(), DType::kBF16) << p.name;
    EXPECT_EQ(p.grad.dtype(), DType::kF32) << p.name;
  }
  auto cpu = make_cpu_backend();
  auto bf = make_bf16_storage_backend(*cpu);
  const Batch global = synthetic_batch(c, 2, 16, 13, 0.1);
  Result<StepResult> got = (*m)->forward_backward(*bf, global, 0);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  LlamaWeights w = LlamaWeights::allocate(c, DType::kBF16, MemCategory::kParameters);
  init_weights(kInit, w);
  LlamaWeights g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  g.zero();
  Result<StepResult> want = model_forward_backward(c, *bf, w, global, StepOptions{}, g);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(got->loss, want->loss);
  LlamaWeights got_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE((*m)->assemble_grads(got_g).ok());
  std::vector<Tensor> want_g;
  g.for_each([&](const std::string&, Tensor& t) { want_g.push_back(t); });
  size_t i = 0;
  got_g.for_each([&](const std::string& name, Tensor& t) { EXPECT_EQ(max_rel_error(t, want_g[i++]), 0.0) << name; });
}

// Each scheme's bytes for a known routing: with a zero router every token picks experts
// 0 .. k-1 (ties to the lower index), so what each rank sends is known exactly. Forward only.
// E experts over D ranks: E/D whole experts per rank, or (E < D) G = D/E ranks per expert,
// each with an f_e / G slice (docs/composition.md section 3 gives the formulas).
void check_counted_traffic(int64_t E, int64_t k) {
  Communicator& world = test::mpi().world();
  const int D = world.size(), p = world.rank();
  SCOPED_TRACE(testing::Message() << "E=" << E << " k=" << k << " D=" << D);
  LlamaConfig c = moe_config(MoeFamily::kMixtral);
  c.moe.num_experts = E;
  c.moe.num_experts_per_tok = k;
  const int64_t B = 2, S = 16, T = B * S / D, h = c.hidden_size;
  const int64_t G = D > E ? D / E : 1, El = D > E ? 1 : E / D, fl = c.moe.moe_intermediate_size / G;
  const int64_t sparse = c.moe.sparse_layer_count(c.num_hidden_layers);
  Batch global = synthetic_batch(c, B, S, 13, 0.1);
  auto be = make_cpu_backend();
  auto run = [&](Layout::MoeDispatchOption dispatch) {
    Layout opt;
    opt.tsp = D;
    opt.moe_dispatch = dispatch;
    Result<TspModel> model = TspModel::create(c, opt, p, S);
    FP_CHECK(model.ok(), "{}", model.status().to_string());
    ShardedWeights tw = ShardedWeights::allocate(c, model->dims(), p, DType::kF32, MemCategory::kParameters);
    init_sharded_weights(kInit, tw);
    for (auto& m : tw.moe)
      if (m.defined()) m.router.zero();
    const CommStats before = world.stats();
    Result<StepResult> r = model->forward(*be, world, tw, model->shard().local_batch(global));
    FP_CHECK(r.ok(), "{}", r.status().to_string());
    return world.stats() - before;
  };
  const CommStats a2a = run(Layout::MoeDispatchOption::kAllToAll);
  const CommStats gather = run(Layout::MoeDispatchOption::kGather);
  const CommStats ring = run(Layout::MoeDispatchOption::kRing);
  // The ranks holding (a slice of) expert e: [first(e), first(e) + G).
  auto first = [&](int64_t e) { return static_cast<int>(G > 1 ? e * G : e / El); };
  auto holds = [&](int64_t e) { return p >= first(e) && p < first(e) + G; };
  // A: this rank's T rows for each chosen expert go to each of its G ranks but itself; each
  // of the other D-1 ranks' T rows for an expert this rank holds go back to them (its partial
  // output). Point-to-point sends carry nothing else in a forward (the weight rings are
  // send_recv).
  int64_t rows_out = 0;
  for (int64_t e = 0; e < k; ++e) rows_out += (G - (holds(e) ? 1 : 0)) * T + (holds(e) ? (D - 1) * T : 0);
  EXPECT_EQ(a2a.op(CommOpKind::kSend).bytes_sent, static_cast<uint64_t>(sparse * rows_out * h * 4));
  EXPECT_EQ(a2a.op(CommOpKind::kAllToAll).calls, static_cast<uint64_t>(sparse));
  EXPECT_EQ(a2a.op(CommOpKind::kAllToAll).bytes_sent, static_cast<uint64_t>(sparse * (D - 1) * El * 8));
  EXPECT_EQ(gather.op(CommOpKind::kSend).bytes_sent, 0u);
  EXPECT_EQ(gather.op(CommOpKind::kAllToAll).calls, 0u);
  // B: the rows, weights and ids of every rank gathered, the outputs reduce-scattered, per
  // sparse layer, whatever G; attention's all-gathers are the same in both runs.
  EXPECT_EQ(gather.op(CommOpKind::kAllGather).bytes_sent - a2a.op(CommOpKind::kAllGather).bytes_sent,
            static_cast<uint64_t>(sparse * (D - 1) * (T * h + 2 * T * k) * 4));
  EXPECT_EQ(gather.op(CommOpKind::kReduceScatter).bytes_sent - a2a.op(CommOpKind::kReduceScatter).bytes_sent,
            static_cast<uint64_t>(sparse * (D - 1) * T * h * 4));
  // C: (D-1) hops of a block of El experts of width f_e / G (3 f h each) per sparse layer,
  // whatever the routing: (D-1)/D E W_e in both cases; the other rings (embedding, head) are
  // the same in both runs.
  EXPECT_EQ(ring.op(CommOpKind::kSend).bytes_sent, 0u);
  EXPECT_EQ(ring.op(CommOpKind::kSendRecv).bytes_sent - a2a.op(CommOpKind::kSendRecv).bytes_sent,
            static_cast<uint64_t>(sparse * (D - 1) * El * 3 * fl * h * 4));
  EXPECT_EQ(D * El * fl, E * c.moe.moe_intermediate_size);
}

TEST(TspMoeTraffic, BytesPerSchemeForACountedRouting) { check_counted_traffic(4, 2); }

// D > E: E = D/2 experts, k = E (every token to every expert), two ranks per expert.
TEST(TspMoeTraffic, SplitExpertsBytesPerSchemeForACountedRouting) {
  const int D = test::mpi().world().size();
  if (D == 1) GTEST_SKIP() << "D > E needs two ranks";
  check_counted_traffic(D / 2, D / 2);
  if (D == 4) check_counted_traffic(1, 1);  // four ranks share the one expert
}

TEST(TspMoeErrors, ExpertsThatDoNotDivide) {
  const int D = test::mpi().world().size();
  if (D == 1) GTEST_SKIP() << "every expert count divides by 1";
  LlamaConfig c = moe_config(MoeFamily::kMixtral);
  c.moe.num_experts = D + 1;  // neither divisible by D nor (for D = 2, 4) below it
  Layout o;
  o.tsp = D;
  Result<TspModel> m = TspModel::create(c, o, 0, 16);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("the " + std::to_string(D + 1) + " experts must divide over the " +
                                      std::to_string(D) + " TSP ranks"),
            std::string::npos)
      << m.status().message();
}

}  // namespace
}  // namespace foldpar

namespace foldpar {
namespace {

// Where MoE models run (validate_layout): one rank, tsp=D and dp=R,tsp=D, in f32 or bf16,
// and the Megatron layouts with the experts over the tp x sp ranks
// (megatron_moe_parity_test); pp on TSP and Megatron stages (pipeline_moe_parity_test),
// under zb refused by name.
TEST(TspMoeLayout, WhatRunsAndWhatIsRefusedByName) {
  const LlamaConfig c = moe_config(MoeFamily::kMixtral);
  for (const char* ok : {"tsp=1", "tsp=2", "tsp=4:moe=ring", "dp=2,tsp=1", "dp=2,tsp=2:moe=gather", "tsp=1:bf16",
                         "tsp=2:bf16", "tsp=4:bf16:moe=a2a", "dp=2,tsp=2:bf16"})
    EXPECT_TRUE(validate_layout(c, parse_layout(ok).value(), 4, 16).ok()) << ok;
  auto message = [&](const char* layout) {
    const Status s = validate_layout(c, parse_layout(layout).value(), 4, 16);
    EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << layout;
    return s.message();
  };
  for (const char* ok : {"tp=2", "dp=2,tp=2", "sp=2", "tp=2,sp=2:seqpar", "tp=4:bf16", "tp=2,sp=4"})
    EXPECT_TRUE(validate_layout(c, parse_layout(ok).value(), 4, 16).ok()) << ok;
  // pp on TSP and Megatron stages runs (pipeline_moe_parity_test); under zb not.
  for (const char* ok : {"pp=2,tsp=2", "pp=2,dp=2,tsp=1:moe=ring", "pp=2,tp=2", "pp=2,sp=2", "pp=2,tp=2,sp=2:seqpar"})
    EXPECT_TRUE(validate_layout(c, parse_layout(ok).value(), 4, 16).ok()) << ok;
  EXPECT_NE(message("pp=2,tp=2:zb").find("the zero-bubble schedule (zb) does not split a mixture-of-experts layer's "
                                         "backward"),
            std::string::npos);
  EXPECT_NE(message("pp=2,tsp=1:zb").find("the zero-bubble schedule (zb) does not split a mixture-of-experts layer's "
                                          "backward"),
            std::string::npos);
  // The expert axis of the Megatron layouts is tp x sp: 4 experts over 3 ranks divide
  // neither way; plain tp dispatches each tp rank's block of S/sp positions.
  const Status tp3 = validate_layout(c, parse_layout("tp=3").value(), 3, 18);
  EXPECT_EQ(tp3.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(tp3.message().find("the 4 experts must divide over the 3 tp x sp ranks (the expert axis)"), std::string::npos)
      << tp3.message();
  const Status rows = validate_layout(c, parse_layout("tp=4,sp=2").value(), 4, 20);
  EXPECT_EQ(rows.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rows.message().find("needs the positions per sp rank (10 = 20 / 2) divisible by tp"), std::string::npos)
      << rows.message();
  EXPECT_TRUE(validate_layout(c, parse_layout("tp=4,sp=2:seqpar").value(), 4, 32).ok());
  // ep=N: the expert group (ep = tp x sp is the default group; ep over dp replicas, under pp
  // per stage; tests/unit/layout_test.cc ExpertGroupsOverDataReplicas has the rest).
  EXPECT_TRUE(validate_layout(c, parse_layout("ep=2,tp=2").value(), 4, 16).ok());
  EXPECT_TRUE(validate_layout(c, parse_layout("pp=2,dp=2,tp=2,ep=4").value(), 4, 16).ok());
  // D > E: two experts over four ranks split each expert's f_e in two; an f_e that does not
  // divide by D/E, or E and D that divide neither way, are refused with the numbers.
  LlamaConfig two = c;
  two.moe.num_experts = 2;
  for (const char* ok : {"tsp=4", "tsp=4:moe=ring", "dp=2,tsp=4:moe=a2a", "tsp=4:bf16"})
    EXPECT_TRUE(validate_layout(two, parse_layout(ok).value(), 4, 16).ok()) << ok;
  two.moe.moe_intermediate_size = 25;
  const Status odd = validate_layout(two, parse_layout("tsp=4").value(), 4, 16);
  EXPECT_EQ(odd.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(odd.message(), "layout tsp=4: moe_intermediate_size (25) must be divisible by the TSP ranks per expert (2 = "
                           "4 ranks / 2 experts)");
  LlamaConfig three = c;
  three.moe.num_experts = 3;
  const Status neither = validate_layout(three, parse_layout("tsp=2").value(), 4, 16);
  EXPECT_EQ(neither.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(neither.message(), "layout tsp=2: the 3 experts must divide over the 2 TSP ranks, or the ranks over the "
                               "experts (D/E ranks share an expert)");
}

TEST(TspMoeLayout, TheDispatchOptionParsesAndSpellsBack) {
  for (const char* text : {"tsp=2:moe=a2a", "tsp=4:moe=gather", "tsp=2:moe=ring"}) {
    Result<Layout> l = parse_layout(text);
    ASSERT_TRUE(l.ok()) << l.status().to_string();
    EXPECT_EQ(l->to_string(), text);
  }
  Result<Layout> dflt = parse_layout("tsp=2:moe=auto");
  ASSERT_TRUE(dflt.ok());
  EXPECT_EQ(dflt->moe_dispatch, Layout::MoeDispatchOption::kAuto);
  EXPECT_EQ(dflt->to_string(), "tsp=2");
  EXPECT_EQ(parse_layout("tsp=2:moe=alltoall").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace foldpar
