// The layout string's strategy.
#include "parallel/make_layout.h"

#include "parallel/strategies.h"

namespace foldpar {

Result<std::unique_ptr<ShardedModel>> make_sharded_model(const LlamaConfig& config, Mesh& mesh, int64_t seq,
                                                         const LayoutOptions& options) {
  const bool tsp = mesh.has_axis("tsp"), tp = mesh.has_axis("tp"), sp = mesh.has_axis("sp");
  if (tsp && !tp && !sp) return make_tsp_sharded_model(config, mesh.comm("tsp"), seq, options);
  if ((tp || sp) && !tsp)
    return make_megatron_sharded_model(config, tp ? &mesh.comm("tp") : nullptr, sp ? &mesh.comm("sp") : nullptr, seq,
                                       options);
  if (!tsp && !tp && !sp)
    return invalid_argument("layout {} has no model axis (tsp, tp or sp)", mesh.layout().to_string());
  return unimplemented("layout {}: tsp does not combine with tp or sp in one mesh", mesh.layout().to_string());
}

Result<std::unique_ptr<ShardedDecoder>> make_sharded_decoder(const LlamaConfig& config, Mesh& mesh,
                                                             const LayoutOptions& options) {
  const std::string layout = mesh.layout().to_string();
  if (mesh.has_axis("dp")) return unimplemented("layout {}: generation does not take a dp axis", layout);
  const bool tsp = mesh.has_axis("tsp"), tp = mesh.has_axis("tp"), sp = mesh.has_axis("sp");
  if (tsp && !tp && !sp) return make_tsp_decoder(config, mesh.comm("tsp"), options);
  if (tp && !tsp && !sp) return make_tp_decoder(config, mesh.comm("tp"), options);
  return unimplemented("layout {}: generation runs on tsp=N or tp=N", layout);
}

}  // namespace foldpar
