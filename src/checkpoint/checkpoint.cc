// Checkpoint writing, discovery and resharding load (checkpoint.h).
#include "checkpoint/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/slice_fill.h"
#include "io/atomic_file.h"
#include "io/posix_file.h"
#include "parallel/failed_ranks.h"
#include "io/safetensors.h"

namespace foldpar {
namespace fs = std::filesystem;
namespace {

constexpr const char* kKinds[3] = {"param", "adam_m", "adam_v"};

std::string step_name(int64_t step) { return fmt::format("step-{:08d}", step); }

std::string entry_name(const char* kind, const GlobalSlice& s) {
  return fmt::format("{}/{}/{},{},{},{}", kind, s.tensor, s.row0, s.rows, s.col0, s.cols);
}

// The block of `local` that `s` describes, in the global orientation [rows, cols]. `local`
// is read with one host copy (it may be device memory); the block is host staging for the
// file, on the host staging tracker (process() may be device memory).
Tensor extract_block(const Tensor& local, const GlobalSlice& s) {
  Tensor block = Tensor::empty({s.rows, s.cols}, DType::kF32, MemCategory::kWorkspace, MemoryTracker::host_staging());
  FP_CHECK(local.dtype() == DType::kF32, "checkpoint block of {}", local.describe());
  const std::vector<float> host = read_host_f32(local);
  const float* src = host.data() + s.offset;
  float* dst = block.data<float>();
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t c = 0; c < s.cols; ++c) dst[r * s.cols + c] = s.transposed ? src[c * s.rows + r] : src[r * s.cols + c];
  return block;
}

// Every rank's verdict on a phase; the failing ranks named when any failed, with the first
// one's error class (so every rank of the job exits with the same code).
Status agree(Communicator& world, const Status& mine, const char* phase) {
  const PhaseVerdict v = agree_on_phase(world, mine);
  if (!mine.ok()) return mine.with_context(fmt::format("checkpoint {}", phase));
  if (v.ok()) return Status();
  return Status(v.first_code, fmt::format("checkpoint {}: rank(s) {} failed (their own messages say why)", phase,
                                          fmt::join(v.failed, ", ")));
}

Status write_rank_file(const std::string& path, const CheckpointWrite& w) {
  std::vector<std::pair<std::string, Tensor>> entries;
  for (size_t i = 0; i < w.params->size(); ++i) {
    const ParamRef& p = (*w.params)[i];
    if (!p.counted || (w.experts_only && !p.routed_expert)) continue;
    const Tensor* sources[3] = {&p.param, w.adam_m ? &(*w.adam_m)[i] : nullptr, w.adam_v ? &(*w.adam_v)[i] : nullptr};
    for (int k = 0; k < 3; ++k) {
      if (sources[k] == nullptr) continue;
      for (const GlobalSlice& s : p.slices) entries.emplace_back(entry_name(kKinds[k], s), extract_block(*sources[k], s));
    }
  }
  return write_safetensors(path, entries, {{"format", "foldpar-checkpoint"}});
}

Status write_manifest(const fs::path& dir, const CheckpointState& st, const std::vector<std::string>& files) {
  nlohmann::ordered_json j;
  j["format"] = "foldpar-checkpoint";
  j["version"] = 1;
  j["step"] = st.step;
  j["next_batch"] = st.next_batch;
  j["seed"] = st.seed;
  j["layout"] = st.layout;
  j["config"] = nlohmann::ordered_json::parse(st.config.to_json());
  j["files"] = files;
  const std::string text = j.dump(2) + "\n";
  return write_file_atomically((dir / "manifest.json").string(), [&](int fd, const std::string& tmp) {
    return write_fully(fd, tmp, text.data(), text.size());
  });
}

// Rank 0: the new directory takes its name, older complete ones beyond `keep` go.
Status publish(const fs::path& root, const fs::path& tmp, const fs::path& final_dir, int keep) {
  std::error_code ec;
  FP_RETURN_IF_ERROR(fsync_directory(tmp.string()));
  const fs::path replaced = root / (".replaced-" + final_dir.filename().string());
  if (fs::exists(final_dir)) {
    fs::remove_all(replaced, ec);
    fs::rename(final_dir, replaced, ec);
    if (ec) return io_error("cannot move the old {} aside: {}", final_dir.string(), ec.message());
  }
  fs::rename(tmp, final_dir, ec);
  if (ec) {
    std::error_code back;
    if (fs::exists(replaced)) fs::rename(replaced, final_dir, back);  // put the old one back
    return io_error("cannot rename {} to {}: {}", tmp.string(), final_dir.string(), ec.message());
  }
  FP_RETURN_IF_ERROR(fsync_directory(root.string()));
  fs::remove_all(replaced, ec);
  std::vector<fs::path> complete;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.path().filename().string().starts_with("step-") && fs::exists(e.path() / "manifest.json"))
      complete.push_back(e.path());
  std::sort(complete.begin(), complete.end());
  for (size_t i = 0; i + static_cast<size_t>(std::max(keep, 1)) < complete.size(); ++i) fs::remove_all(complete[i], ec);
  return Status();
}

bool parse_entry(const std::string& name, std::string* kind, std::string* tensor, GlobalBox* box) {
  const size_t a = name.find('/'), b = name.rfind('/');
  if (a == std::string::npos || b == a) return false;
  *kind = name.substr(0, a);
  *tensor = name.substr(a + 1, b - a - 1);
  long long r0, rn, c0, cn;
  if (std::sscanf(name.c_str() + b + 1, "%lld,%lld,%lld,%lld", &r0, &rn, &c0, &cn) != 4) return false;
  *box = GlobalBox{r0, rn, c0, cn};
  return r0 >= 0 && rn >= 0 && c0 >= 0 && cn >= 0;
}


}  // namespace

Result<std::string> save_checkpoint(const std::string& root_str, const CheckpointState& st, const CheckpointWrite& w,
                                    Communicator& world) {
  const fs::path root(root_str), final_dir = root / step_name(st.step),
                 tmp = root / (".incomplete-" + step_name(st.step));
  Status s;
  if (world.rank() == 0) {
    std::error_code ec;
    fs::create_directories(root, ec);
    if (!ec) fs::remove_all(tmp, ec);
    if (!ec) fs::create_directory(tmp, ec);
    if (ec) s = io_error("cannot create {}: {}", tmp.string(), ec.message());
  }
  FP_RETURN_IF_ERROR(agree(world, s, "directory"));
  const std::string file = fmt::format("rank-{:05d}.safetensors", world.rank());
  if (w.writes) s = write_rank_file((tmp / file).string(), w);
  if (s.ok() && w.hooks.after_rank_file) s = w.hooks.after_rank_file(st.step, world.rank(), world.size());
  const int32_t writes = w.writes ? 1 : 0;
  std::vector<int32_t> writers(static_cast<size_t>(world.size()));
  FP_CHECK_OK(world.all_gather(&writes, writers.data(), 1, DType::kI32));
  Status written = agree(world, s, "write");
  if (written.ok() && world.rank() == 0) {
    std::vector<std::string> files;
    for (int r = 0; r < world.size(); ++r)
      if (writers[r]) files.push_back(fmt::format("rank-{:05d}.safetensors", r));
    s = write_manifest(tmp, st, files);
    if (s.ok()) s = publish(root, tmp, final_dir, w.keep);
  }
  if (!written.ok() && world.rank() == 0) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
  }
  FP_RETURN_IF_ERROR(written);
  FP_RETURN_IF_ERROR(agree(world, s, "publish"));
  return final_dir.string();
}

Result<std::string> latest_checkpoint(const std::string& root) {
  std::error_code ec;
  std::string best;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("step-") && fs::exists(e.path() / "manifest.json") && name > fs::path(best).filename().string())
      best = e.path().string();
  }
  if (best.empty()) return not_found("no complete checkpoint under '{}'", root);
  return best;
}

Result<std::string> resolve_checkpoint(const std::string& dir) {
  if (!fs::is_directory(dir)) return not_found("checkpoint directory '{}' does not exist", dir);
  if (fs::exists(fs::path(dir) / "manifest.json")) return dir;
  if (Result<std::string> r = latest_checkpoint(dir); r.ok()) return r;
  if (Result<std::string> r = latest_checkpoint((fs::path(dir) / "checkpoints").string()); r.ok()) return r;
  return not_found("no complete checkpoint in '{}' or '{}/checkpoints'", dir, dir);
}

namespace {

// nlohmann parses iteratively, but dump() recurses: a hostile manifest nesting 100k levels
// deep would overflow the stack there. A valid one nests 3 levels (manifest, config,
// architectures).
constexpr int kMaxManifestDepth = 16;

// A manifest value quoted into a message: its JSON, ASCII only, at most 100 bytes.
std::string quote(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', /*ensure_ascii=*/true);
  return s.size() <= 100 ? s : s.substr(0, 100) + "...";
}

// A rank file's name: a plain name inside the checkpoint directory, never a path.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

Result<CheckpointManifest> parse_checkpoint_manifest(std::string_view text) {
  bool too_deep = false;
  const nlohmann::json j = nlohmann::json::parse(
      text,
      [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > kMaxManifestDepth) too_deep = true;
        return depth <= kMaxManifestDepth;  // deeper values are not even kept
      },
      /*allow_exceptions=*/false);
  if (too_deep) return corrupt("the manifest nests deeper than {} levels", kMaxManifestDepth);
  if (j.is_discarded()) return corrupt("the manifest is not valid JSON");
  if (!j.is_object()) return corrupt("the manifest must be a JSON object, not {}", j.type_name());
  const auto field = [&](const char* key) -> const nlohmann::json* {
    auto it = j.find(key);
    return it == j.end() ? nullptr : &*it;
  };
  const nlohmann::json* format = field("format");
  if (format == nullptr || !format->is_string() || format->get_ref<const std::string&>() != "foldpar-checkpoint")
    return corrupt("\"format\" must be \"foldpar-checkpoint\", not {}", format ? quote(*format) : "missing");
  if (const nlohmann::json* v = field("version"); v != nullptr && *v != 1)
    return corrupt("manifest version {} (this build reads 1)", quote(*v));
  CheckpointManifest m;
  CheckpointState& st = m.state;
  const nlohmann::json* step = field("step");
  if (step == nullptr || !step->is_number_integer() || step->get<int64_t>() < 0)
    return corrupt("\"step\" must be an integer in [0, 2^63), not {}", step ? quote(*step) : "missing");
  st.step = step->get<int64_t>();
  const nlohmann::json* next_batch = field("next_batch");
  if (next_batch == nullptr || !next_batch->is_number_unsigned())
    return corrupt("\"next_batch\" must be a non-negative integer, not {}", next_batch ? quote(*next_batch) : "missing");
  st.next_batch = next_batch->get<uint64_t>();
  if (const nlohmann::json* seed = field("seed"); seed != nullptr) {
    if (!seed->is_number_unsigned()) return corrupt("\"seed\" must be a non-negative integer, not {}", quote(*seed));
    st.seed = seed->get<uint64_t>();
  }
  if (const nlohmann::json* layout = field("layout"); layout != nullptr) {
    if (!layout->is_string()) return corrupt("\"layout\" must be a string, not {}", quote(*layout));
    st.layout = layout->get<std::string>();
  }
  const nlohmann::json* config = field("config");
  if (config == nullptr || !config->is_object())
    return corrupt("\"config\" must be an object, not {}", config ? quote(*config) : "missing");
  Result<LlamaConfig> c = LlamaConfig::from_json(config->dump());
  if (!c.ok()) return c.status().with_context("manifest");
  st.config = c.value();
  const nlohmann::json* files = field("files");
  if (files == nullptr || !files->is_array())
    return corrupt("\"files\" must be an array of file names, not {}", files ? quote(*files) : "missing");
  for (const nlohmann::json& f : *files) {
    if (!f.is_string() || !is_plain_file_name(f.get_ref<const std::string&>()))
      return corrupt("\"files\" must hold plain file names in the checkpoint directory, not {}", quote(f));
    m.files.push_back(f.get<std::string>());
  }
  return m;
}

namespace {

Result<CheckpointManifest> read_manifest(const std::string& dir) {
  const fs::path path = fs::path(dir) / "manifest.json";
  std::ifstream in(path);
  if (!in) return not_found("'{}' is not a checkpoint (no manifest.json)", dir);
  std::stringstream ss;
  ss << in.rdbuf();
  Result<CheckpointManifest> m = parse_checkpoint_manifest(ss.str());
  if (!m.ok()) return m.status().with_context(path.string());
  return m;
}

}  // namespace

Result<CheckpointState> read_checkpoint_state(const std::string& dir) {
  FP_ASSIGN_OR_RETURN(CheckpointManifest m, read_manifest(dir));
  return m.state;
}

Status load_checkpoint(const std::string& dir, const LlamaConfig& config, std::vector<ParamRef>& params,
                       std::vector<Tensor>* adam_m, std::vector<Tensor>* adam_v) {
  FP_ASSIGN_OR_RETURN(CheckpointManifest manifest, read_manifest(dir));
  FP_RETURN_IF_ERROR(same_config(manifest.state.config, config));
  std::vector<SafetensorsFile> opened;
  BlockIndex index;
  for (const std::string& f : manifest.files) {
    FP_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open((fs::path(dir) / f).string()));
    for (const SafetensorsEntry& e : file.entries()) {
      std::string kind, tensor;
      GlobalBox box{};
      if (!parse_entry(e.name, &kind, &tensor, &box) || e.dtype != DType::kF32 ||
          e.shape.numel() != box.rows * box.cols)
        return corrupt("checkpoint {}: malformed entry '{}' in {}", dir, e.name, file.path());
      index[{kind, tensor}].push_back(StoredBlock{opened.size(), e.name, box});
    }
    opened.push_back(std::move(file));
  }
  const std::string what = "checkpoint " + dir;
  FP_RETURN_IF_ERROR(fill_slices(what, kKinds[0], params, tensors_of(params), opened, index));
  if (adam_m != nullptr) FP_RETURN_IF_ERROR(fill_slices(what, kKinds[1], params, tensors_of(*adam_m), opened, index));
  if (adam_v != nullptr) FP_RETURN_IF_ERROR(fill_slices(what, kKinds[2], params, tensors_of(*adam_v), opened, index));
  return Status();
}

}  // namespace foldpar
