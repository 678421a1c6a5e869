// Checkpoints that reshard. One directory per step, <root>/step-NNNNNNNN, holding
// manifest.json (config, layout, step, data position, seed) and one safetensors file per
// writing rank. Every tensor a rank holds is written as the blocks of the global (Hugging
// Face) tensors it covers (ParamRef::slices), in the global orientation, named
// "<kind>/<global tensor>/<row0>,<rows>,<col0>,<cols>" with kind param, adam_m or adam_v;
// replicated copies are written once (ParamRef::counted). A reader under ANY layout fills
// each of its slices from the intersecting blocks, so tsp=4 -> tsp=2 -> tp=2,sp=2 -> one
// rank all load, optimizer state included.
//
// Atomicity: the files go into <root>/.incomplete-step-N; only when every rank has written
// its file does rank 0 add the manifest and rename the directory to step-N. A directory
// named step-N with a manifest is complete; anything else is ignored (and cleaned up). The
// newest `keep` complete checkpoints stay; older ones are removed after the new one is in
// place, so a failure never leaves fewer than the previous complete checkpoint.
// Hugging Face directories, the other stored form, are hf_directory.h's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "core/status.h"
#include "model/llama_config.h"
#include "parallel/param_ref.h"

namespace foldpar {

struct CheckpointState {
  int64_t step = 0;         // optimizer steps completed
  uint64_t next_batch = 0;  // data position: the next training batch number
  uint64_t seed = 0;
  std::string layout;       // of the writer (informative: loading reshards)
  LlamaConfig config;
};

// Seams for the fault tests, empty in production (leveldb's injected Env, not environment
// switches in library code). The program builds them from FOLDPAR_FAULT_* variables
// (tools/fault_injection.h) for the e2e fault tests; unit tests set them directly.
struct CheckpointHooks {
  // Runs on every rank whose own file of checkpoint `step` was written (and on ranks that
  // write none), before the ranks agree on the write and before the checkpoint is
  // published. A non-OK Status counts as this rank's write failing.
  std::function<Status(int64_t step, int rank, int world_size)> after_rank_file;
};

struct CheckpointWrite {
  const std::vector<ParamRef>* params = nullptr;
  const std::vector<Tensor>* adam_m = nullptr;  // optional, aligned with params
  const std::vector<Tensor>* adam_v = nullptr;
  bool writes = true;   // false on ranks whose tensors another rank already writes (data-parallel replicas)
  int keep = 2;         // complete checkpoints kept
  CheckpointHooks hooks{};  // none by default
  // Write the routed experts only (ParamRef::routed_expert): a dp replica other than the first
  // that holds experts no other writer holds (experts over dp replicas, Layout::ep).
  bool experts_only = false;
};

// Collective over `world`. Returns the directory written. On any rank's failure every rank
// returns an error and the previous checkpoints are untouched.
Result<std::string> save_checkpoint(const std::string& root, const CheckpointState& state, const CheckpointWrite& w,
                                    Communicator& world);

// The newest complete checkpoint under root; not_found when there is none.
Result<std::string> latest_checkpoint(const std::string& root);
// What a command's --checkpoint names: a step-N directory itself (it holds manifest.json), or
// the newest complete checkpoint under DIR (a checkpoints/ folder) or DIR/checkpoints (a
// training directory, `train --out DIR`). not_found naming `dir` when it holds none.
Result<std::string> resolve_checkpoint(const std::string& dir);
Result<CheckpointState> read_checkpoint_state(const std::string& dir);

// What manifest.json says: the state and the rank files (names inside the directory).
struct CheckpointManifest {
  CheckpointState state;
  std::vector<std::string> files;
};
// Validates the text of a manifest.json. Pure (no I/O), so a fuzzer can drive it: any input
// gives the manifest or a kCorrupt / kInvalidArgument Status, never a crash.
Result<CheckpointManifest> parse_checkpoint_manifest(std::string_view text);

// Fills every slice of `params` (and the moments when given) from the checkpoint at `dir`,
// whatever layout wrote it. kCorrupt when a slice is not fully covered; invalid_argument
// when the checkpoint's config does not match `config`. Not collective.
Status load_checkpoint(const std::string& dir, const LlamaConfig& config, std::vector<ParamRef>& params,
                       std::vector<Tensor>* adam_m, std::vector<Tensor>* adam_v);

}  // namespace foldpar
