// PLACEHOLDER until the tp strategy lands (issue 5): the factory refuses the layout.
#include "parallel/strategies.h"

namespace foldpar {

Result<std::unique_ptr<ShardedModel>> make_tp_sharded_model(const LlamaConfig&, Communicator& tp, int64_t,
                                                            const LayoutOptions&) {
  return unimplemented("layout tp={}: tensor parallelism is not built yet", tp.size());
}

}  // namespace foldpar
