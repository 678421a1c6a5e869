// PLACEHOLDER until the sp strategy lands (issue 5): the factory refuses the layout.
#include "parallel/strategies.h"

namespace foldpar {

Result<std::unique_ptr<ShardedModel>> make_sp_sharded_model(const LlamaConfig&, Communicator& sp, int64_t,
                                                            const LayoutOptions&) {
  return unimplemented("layout sp={}: sequence parallelism is not built yet", sp.size());
}

}  // namespace foldpar
