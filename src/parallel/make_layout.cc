// The layout's strategy, over a mesh made from the same layout.
#include "parallel/make_layout.h"

#include <algorithm>

#include "comm/counting_communicator.h"
#include "parallel/single_rank_model.h"
#include "parallel/strategies.h"

namespace foldpar {
namespace {

// The mesh must have the layout's degrees (layout.mesh(); an axis of degree 1 may be in the
// mesh or not: the strategy runs a missing one on a size-1 communicator).
Status check_mesh(const Mesh& mesh, const Layout& layout) {
  const std::pair<const char*, int> axes[] = {
      {"pp", layout.pp}, {"dp", layout.dp}, {"tsp", layout.tsp}, {"tp", layout.tp}, {"sp", layout.sp}};
  for (const auto& [axis, degree] : axes)
    if (mesh.degree(axis) != degree)
      return invalid_argument("layout {} runs on the mesh {}, but the mesh is {}", layout.to_string(), layout.mesh(),
                              mesh.layout().to_string());
  if (layout.strategy == Strategy::kTsp ? !mesh.has_axis("tsp") : mesh.has_axis("tsp"))
    return invalid_argument("layout {} runs on the mesh {}, but the mesh is {}", layout.to_string(), layout.mesh(),
                            mesh.layout().to_string());
  return Status();
}

Communicator* axis_comm(Mesh& mesh, const char* axis) { return mesh.has_axis(axis) ? &mesh.comm(axis) : nullptr; }

// Generation under pp: TSP or tp stages (what parallel/pipeline/pipeline_decoder.h runs
// them with), the conditions make_sharded_decoder checked.
Result<std::unique_ptr<ShardedDecoder>> make_pipeline_stages_decoder(const LlamaConfig& config, Mesh& mesh,
                                                                    const Layout& layout) {
  Communicator& pp = mesh.comm("pp");
  // Contiguous stages whatever the training schedule: decoding has no backward to interleave
  // or split.
  Layout contiguous = layout;
  contiguous.chunks = 1;
  contiguous.zero_bubble = false;
  const std::vector<int64_t> bounds = stage_bounds(config, contiguous);
  const int s = pp.rank();
  const StageLayers layers{bounds[s], bounds[s + 1], s == 0, s == layout.pp - 1, {}};
  Result<std::unique_ptr<StageDecoder>> stage =
      layout.strategy == Strategy::kTsp ? make_tsp_stage_decoder(config, mesh.comm("tsp"), contiguous, layers)
                                        : make_tp_stage_decoder(config, mesh.comm("tp"), contiguous, layers);
  FP_RETURN_IF_ERROR(stage.status());
  return make_pipeline_decoder(config, pp, std::move(*stage), contiguous);
}

// The world ranks of this rank's `axis` group in axis order (this rank alone where the mesh
// lacks the axis).
std::vector<int> axis_ranks(Mesh& mesh, const char* axis) {
  return mesh.has_axis(axis) ? mesh.comm(axis).world_ranks() : std::vector<int>{mesh.world().rank()};
}

// The communicator of the listed world ranks (this one's among them, ranked in that order),
// split off the world and made as the mesh's axes are (Mesh::split_group: a device or
// guarded communicator where they are one); in a dry run the counting world's group.
// Collective over the world: every rank calls it with its own group (the groups partition
// the world).
std::unique_ptr<Communicator> split_group(Mesh& mesh, const std::vector<int>& group, const char* name) {
  if (auto* counting = dynamic_cast<CountingCommunicator*>(&mesh.world()))
    return counting->group(group, name);  // a dry run: no peers to split with
  const int me = mesh.world().rank();
  const int key = static_cast<int>(std::find(group.begin(), group.end(), me) - group.begin());
  return mesh.split_group(*std::min_element(group.begin(), group.end()), key, name);
}

// This rank's model group, the unit an expert group repeats over dp replicas.
struct ModelGroup {
  // Its world ranks in expert-axis order (TSP: the tsp axis; Megatron: rank sp * tp + t).
  std::vector<int> model;
  // Those with this rank's weight-axis rank (Megatron: the sp ranks of this tp rank; TSP:
  // this rank alone): assembly over the weight axis leaves each of them one set of experts.
  std::vector<int> across;
};

ModelGroup megatron_group(Mesh& mesh, const Layout& layout) {
  const std::vector<int> tw = axis_ranks(mesh, "tp"), sw = axis_ranks(mesh, "sp");
  const int t = mesh.coord("tp"), s = mesh.coord("sp"), me = mesh.world().rank();
  ModelGroup g;
  for (int q = 0; q < layout.sp; ++q) {
    g.across.push_back(me + sw[q] - sw[s]);
    for (int r = 0; r < layout.tp; ++r) g.model.push_back(me + sw[q] - sw[s] + tw[r] - tw[t]);
  }
  return g;
}

// A MoE model on tp=T,sp=Q (a pipeline stage's too): its expert axis is the tp x sp group,
// split off the world per dp replica and pp stage (rank sp * T + t); null with one of the
// axes, where the other is the group, and where the expert group spans dp replicas
// (make_expert_data_axes). Collective over the world when split.
std::unique_ptr<Communicator> make_expert_axis(const LlamaConfig& config, Mesh& mesh, const Layout& layout) {
  if (!config.moe.enabled() || layout.tp == 1 || layout.sp == 1 || layout.expert_replicas() > 1) return nullptr;
  return split_group(mesh, megatron_group(mesh, layout).model, "ep");
}

// Expert parallelism over dp (ep = K G): the expert group of K consecutive dp replicas' model
// groups (rank k G + this rank's place on its model group), the group's ranks that hold this
// rank's weight-axis slices (assembly sums the experts over them) and the dp/K replicas that
// hold this rank's experts (their gradients' sum). Empty unless K > 1. Collective over the world.
ExpertDataAxes make_expert_data_axes(const LlamaConfig& config, Mesh& mesh, const Layout& layout) {
  const int K = layout.expert_replicas();
  if (!config.moe.enabled() || K == 1) return {};
  const ModelGroup g = layout.strategy == Strategy::kTsp
                           ? ModelGroup{axis_ranks(mesh, "tsp"), {mesh.world().rank()}}
                           : megatron_group(mesh, layout);
  const std::vector<int> dw = axis_ranks(mesh, "dp");
  const int d = mesh.coord("dp"), me = mesh.world().rank(), first = d / K * K;
  std::vector<int> group, across, data;
  for (int k = 0; k < K; ++k) {
    const int shift = dw[static_cast<size_t>(first + k)] - me;
    for (int r : g.model) group.push_back(r + shift);
    for (int r : g.across) across.push_back(r + shift);
  }
  for (int j = d % K; j < layout.dp; j += K) data.push_back(dw[static_cast<size_t>(j)]);
  ExpertDataAxes axes;
  axes.group = split_group(mesh, group, "ep");
  axes.across = split_group(mesh, across, "ep_across");
  axes.data = split_group(mesh, data, "edp");
  return axes;
}

}  // namespace

Result<std::unique_ptr<ShardedModel>> make_sharded_model(const LlamaConfig& config, Mesh& mesh, int64_t seq,
                                                         const Layout& layout) {
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, seq));
  FP_RETURN_IF_ERROR(check_mesh(mesh, layout));
  // validate_layout: a MoE model runs on one rank (in the single-rank model), on dp=R,tsp=D
  // (TSP, D = 1 included), or on the Megatron layouts with expert parallelism over tp x sp;
  // under pp on stages of either (and dp). The attention variants (biases, q/k norms) run in the
  // strategies, one rank included.
  if (layout.ranks() == 1 && config.moe.enabled())
    return make_single_rank_model(config, layout);
  // Experts over dp replicas: the mesh's dp and model axes are a stage's own, so each
  // stage's expert groups are cut from its own ranks (never across stages).
  ExpertDataAxes wide = make_expert_data_axes(config, mesh, layout);
  if (layout.pp > 1) {
    Result<std::unique_ptr<StageStrategy>> stage =
        layout.strategy == Strategy::kTsp
            ? make_tsp_stage_strategy(config, mesh.comm("tsp"), axis_comm(mesh, "dp"), seq, layout, std::move(wide))
            : make_megatron_stage_strategy(config, axis_comm(mesh, "tp"), axis_comm(mesh, "sp"), seq, layout,
                                           make_expert_axis(config, mesh, layout), axis_comm(mesh, "dp"),
                                           std::move(wide));
    FP_RETURN_IF_ERROR(stage.status());
    return make_pipeline_model(config, mesh.comm("pp"), std::move(*stage), layout);
  }
  if (layout.strategy == Strategy::kTsp)
    return make_tsp_sharded_model(config, mesh.comm("tsp"), axis_comm(mesh, "dp"), seq, layout, std::move(wide));
  return make_megatron_sharded_model(config, axis_comm(mesh, "tp"), axis_comm(mesh, "sp"), seq, layout,
                                     make_expert_axis(config, mesh, layout), axis_comm(mesh, "dp"), std::move(wide));
}

Result<std::unique_ptr<ShardedDecoder>> make_sharded_decoder(const LlamaConfig& config, Mesh& mesh,
                                                             const Layout& layout) {
  const std::string name = layout.to_string();
  if (layout.dp > 1) return unimplemented("layout {}: generation does not take a dp axis", name);
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, 0));
  FP_RETURN_IF_ERROR(check_mesh(mesh, layout));
  // Every decoder keeps f32 weights and an f32 KV cache (parallel/decode_block.h).
  if (layout.dtype != DType::kF32)
    return unimplemented("layout {}: generation runs in f32 (f32 weights and KV cache); bf16 is not implemented", name);
  if (layout.sp > 1) return unimplemented("layout {}: generation runs on tsp=N or tp=N (under pp: on such stages)", name);
  if (layout.pp > 1) return make_pipeline_stages_decoder(config, mesh, layout);
  if (layout.strategy == Strategy::kTsp) return make_tsp_decoder(config, mesh.comm("tsp"), layout);
  if (mesh.has_axis("tp")) return make_tp_decoder(config, mesh.comm("tp"), layout);
  return unimplemented("layout {}: generation runs on tsp=N or tp=N", name);
}

}  // namespace foldpar
