// Reading a byte-level BPE tokenizer.json's vocabulary.
#include "data/tokenizer_vocab.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace foldpar {
namespace {

using json = nlohmann::json;

Status place(ByteLevelBpeVocab& v, int64_t id, const std::string& text, ByteLevelBpeVocab::Kind kind,
             const std::string& path) {
  if (id < 0 || id > (1 << 30)) return invalid_argument("{}: token id {} ('{}') is out of range", path, id, text);
  if (static_cast<size_t>(id) >= v.tokens.size()) {
    v.tokens.resize(id + 1);
    v.kinds.resize(id + 1, ByteLevelBpeVocab::Kind::kMissing);
  }
  v.tokens[id] = text;
  v.kinds[id] = kind;
  return Status::ok_status();
}

// The Split regex of a Sequence [Split, ByteLevel] pre-tokenizer.
Result<std::string> split_regex(const json& pre, const std::string& path) {
  const bool ok = pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers") &&
                  pre["pretokenizers"].is_array() && pre["pretokenizers"].size() == 2 &&
                  pre["pretokenizers"][0].value("type", "") == "Split" &&
                  pre["pretokenizers"][1].value("type", "") == "ByteLevel";
  if (!ok) return invalid_argument("{}: GGUF export reads byte-level BPE with a Split and a ByteLevel pre-tokenizer, not {}", path, pre.dump().substr(0, 100));
  const json& pattern = pre["pretokenizers"][0].value("pattern", json::object());
  if (!pattern.contains("Regex") || !pattern["Regex"].is_string())
    return invalid_argument("{}: the Split pre-tokenizer has no Regex pattern", path);
  return pattern["Regex"].get<std::string>();
}

}  // namespace

Result<ByteLevelBpeVocab> read_byte_level_bpe_vocab(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found("cannot read '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  const json j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("model") || !j["model"].is_object())
    return invalid_argument("{}: not a tokenizer.json (no model object)", path);
  const json& model = j["model"];
  if (model.value("type", "") != "BPE") return invalid_argument("{}: GGUF export of model type '{}' is not implemented", path, model.value("type", ""));
  if (model.value("byte_fallback", false))
    return invalid_argument("{}: GGUF export of byte-fallback BPE (Llama 2 style) is not implemented", path);
  ByteLevelBpeVocab v;
  FP_ASSIGN_OR_RETURN(v.split_regex, split_regex(j.value("pre_tokenizer", json()), path));
  if (!model.contains("vocab") || !model["vocab"].is_object()) return invalid_argument("{}: the model has no vocab", path);
  for (const auto& [text, id] : model["vocab"].items()) {
    if (!id.is_number_integer()) return invalid_argument("{}: vocab entry '{}' has no integer id", path, text);
    FP_RETURN_IF_ERROR(place(v, id.get<int64_t>(), text, ByteLevelBpeVocab::Kind::kNormal, path));
  }
  for (const json& m : model.value("merges", json::array())) {
    if (m.is_string()) v.merges.push_back(m.get<std::string>());
    else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string())
      v.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    else return invalid_argument("{}: merge {} is neither \"a b\" nor [\"a\", \"b\"]", path, m.dump().substr(0, 60));
  }
  for (const json& t : j.value("added_tokens", json::array())) {
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") || !t["content"].is_string())
      return invalid_argument("{}: an added token lacks id or content", path);
    const auto kind = t.value("special", false) ? ByteLevelBpeVocab::Kind::kSpecial : ByteLevelBpeVocab::Kind::kAdded;
    FP_RETURN_IF_ERROR(place(v, t["id"].get<int64_t>(), t["content"].get<std::string>(), kind, path));
  }
  return v;
}

}  // namespace foldpar
