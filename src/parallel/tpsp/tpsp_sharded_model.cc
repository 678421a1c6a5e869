// PLACEHOLDER until the tp x sp strategy lands (issue 5): the factory refuses the layout.
#include "parallel/strategies.h"

namespace foldpar {

Result<std::unique_ptr<ShardedModel>> make_tpsp_sharded_model(const LlamaConfig&, Communicator& tp,
                                                              Communicator& sp, int64_t, const LayoutOptions&) {
  return unimplemented("layout tp={},sp={}: the 2-D mesh is not built yet", tp.size(), sp.size());
}

}  // namespace foldpar
