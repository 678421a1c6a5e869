// Reading and writing config.json's "rope_scaling" object (backend/rope_table.h's
// RopeScaling), kept beside llama_config.cc so the config parser stays one read per field.
#pragma once

#include <nlohmann/json.hpp>

#include "backend/rope_table.h"
#include "core/status.h"

namespace foldpar {

// rope_scaling: null, or an object with "rope_type" (or "type") one of default, linear,
// dynamic, llama3, yarn and that type's fields. An unknown type or a field the type does not
// read is refused by name; required fields (factor; llama3's low/high_freq_factor and
// original_max_position_embeddings) must be present; values are range-checked.
Result<RopeScaling> read_rope_scaling(const nlohmann::json& value);
// The object read_rope_scaling reads back (null when not enabled).
nlohmann::ordered_json rope_scaling_json(const RopeScaling& s);

}  // namespace foldpar
