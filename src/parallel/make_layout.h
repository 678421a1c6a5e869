// Building the ShardedModel a layout string names, over a mesh made from it.
#pragma once

#include <memory>

#include "comm/mesh.h"
#include "parallel/sharded_decoder.h"
#include "parallel/sharded_model.h"

namespace foldpar {

// The strategy of the layout's model axes (tsp=D; tp=T; sp=S; tp=T,sp=S; with pp=P the
// pipeline over stages of that strategy, parallel/pipeline/) over a mesh made
// from layout.mesh(). (A dp axis is the training loop's business: the model is built over
// the other axes.) validate_layout's verdict first, then a mesh that does not match the
// layout; unimplemented for layouts foldpar does not have. The mesh must outlive the model.
// Not collective.
Result<std::unique_ptr<ShardedModel>> make_sharded_model(const LlamaConfig& config, Mesh& mesh, int64_t seq,
                                                         const Layout& layout);

// The decoder of a generation layout: tsp=D, tp=T, or pp=P,tsp=D (pipeline/pipeline_decoder.h;
// f32) (a dp axis is not a model axis and is refused here: generation runs one replica).
// validate_layout's verdict first, unimplemented for the other layouts. The mesh must outlive the decoder. Not collective.
Result<std::unique_ptr<ShardedDecoder>> make_sharded_decoder(const LlamaConfig& config, Mesh& mesh,
                                                             const Layout& layout);

}  // namespace foldpar
