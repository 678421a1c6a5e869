// The layout's strategy, over a mesh made from the same layout.
#include "parallel/make_layout.h"

#include "parallel/strategies.h"

namespace foldpar {
namespace {

// The mesh must have been made from layout.mesh(): the same axes, the same degrees.
Status check_mesh(const Mesh& mesh, const Layout& layout) {
  if (mesh.layout().to_string() != layout.mesh())
    return invalid_argument("layout {} runs on the mesh {}, but the mesh is {}", layout.to_string(), layout.mesh(),
                            mesh.layout().to_string());
  return Status();
}

}  // namespace

Result<std::unique_ptr<ShardedModel>> make_sharded_model(const LlamaConfig& config, Mesh& mesh, int64_t seq,
                                                         const Layout& layout) {
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, seq));
  FP_RETURN_IF_ERROR(check_mesh(mesh, layout));
  if (layout.strategy == Strategy::kTsp) return make_tsp_sharded_model(config, mesh.comm("tsp"), seq, layout);
  if (layout.tp > 1 && layout.sp > 1)
    return make_tpsp_sharded_model(config, mesh.comm("tp"), mesh.comm("sp"), seq, layout);
  if (layout.sp > 1) return make_sp_sharded_model(config, mesh.comm("sp"), seq, layout);
  return make_tp_sharded_model(config, mesh.comm("tp"), seq, layout);
}

Result<std::unique_ptr<ShardedDecoder>> make_sharded_decoder(const LlamaConfig& config, Mesh& mesh,
                                                             const Layout& layout) {
  const std::string name = layout.to_string();
  if (layout.dp > 1) return unimplemented("layout {}: generation does not take a dp axis", name);
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, 0));
  FP_RETURN_IF_ERROR(check_mesh(mesh, layout));
  if (layout.strategy == Strategy::kTsp) return make_tsp_decoder(config, mesh.comm("tsp"), layout);
  if (layout.sp == 1) return make_tp_decoder(config, mesh.comm("tp"), layout);
  return unimplemented("layout {}: generation runs on tsp=N or tp=N", name);
}

}  // namespace foldpar
