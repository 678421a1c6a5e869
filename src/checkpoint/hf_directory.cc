// Hugging Face directories: reading into any layout's slices, writing full weights.
#include "checkpoint/hf_directory.h"

#include <filesystem>
#include <utility>
#include <vector>

#include "checkpoint/slice_fill.h"
#include "io/atomic_file.h"
#include "io/posix_file.h"
#include "io/safetensors.h"

namespace foldpar {
namespace fs = std::filesystem;

Status load_hf_weights(const std::string& dir, const LlamaConfig& config, std::vector<ParamRef>& params) {
  FP_ASSIGN_OR_RETURN(LlamaConfig theirs, LlamaConfig::load((fs::path(dir) / "config.json").string()));
  FP_RETURN_IF_ERROR(same_config(theirs, config));
  std::vector<SafetensorsFile> opened;
  FP_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open((fs::path(dir) / "model.safetensors").string()));
  BlockIndex index;
  for (const SafetensorsEntry& e : file.entries()) {
    const int64_t cols = e.shape.rank() == 0 ? 1 : e.shape[e.shape.rank() - 1];
    const int64_t rows = cols == 0 ? 0 : e.shape.numel() / cols;
    index[{"param", e.name}].push_back(StoredBlock{0, e.name, GlobalBox{0, rows, 0, cols}});
  }
  opened.push_back(std::move(file));
  return fill_slices("weights " + dir, "param", params, tensors_of(params), opened, index);
}

Status write_hf_directory(const std::string& dir, const LlamaConfig& config, const LlamaWeights& weights) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("cannot create '{}': {}", dir, ec.message());
  const std::string text = config.to_json();
  FP_RETURN_IF_ERROR(write_file_atomically((fs::path(dir) / "config.json").string(), [&](int fd, const std::string& tmp) {
    return write_fully(fd, tmp, text.data(), text.size());
  }));
  std::vector<std::pair<std::string, Tensor>> list;
  weights.for_each([&](const std::string& name, const Tensor& t) { list.emplace_back(name, t); });
  return write_safetensors((fs::path(dir) / "model.safetensors").string(), list, {{"format", "pt"}});
}

}  // namespace foldpar
