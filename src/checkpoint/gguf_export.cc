// GGUF export of a Llama model: metadata, llama.cpp tensor names, the RoPE row order.
#include "checkpoint/gguf_export.h"

#include <fmt/format.h>

#include <algorithm>

namespace foldpar {
namespace {

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xc0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    s += static_cast<char>(0xe0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  }
  return s;
}

bool printable_byte(uint32_t b) { return (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae; }

// llama.cpp's general.file_type: 0 all f32, 1 mostly f16, 32 mostly bf16.
uint32_t file_type(GgufDType d) { return d == GgufDType::kF32 ? 0 : d == GgufDType::kF16 ? 1 : 32; }

GgufTensorType matrix_type(GgufDType d) {
  return d == GgufDType::kF32 ? GgufTensorType::kF32 : d == GgufDType::kF16 ? GgufTensorType::kF16 : GgufTensorType::kBF16;
}

// The llama.cpp architecture a config is written as. Its RoPE decides the q/k row order:
// "llama" rotates adjacent pairs (rows permuted, see the header), "qwen2" and "qwen3" rotate
// the halves like Hugging Face (NeoX style in llama.cpp: rows kept).
struct GgufArch {
  std::string name;
  bool permute_qk = true;
};

Result<GgufArch> gguf_architecture(const LlamaConfig& c) {
  // llama.cpp's qwen3 reads the q/k norms and no biases; its qwen2 the q/k/v biases and no
  // o_proj bias; its llama all four attention biases and the three MLP biases, all optional.
  if (c.qk_norm) {
    if (c.qkv_bias || c.o_bias)
      return unimplemented("GGUF export of qwen3 with attention_bias (q/k/v/o biases) is not supported: llama.cpp's "
                           "qwen3 architecture reads no attention biases");
    return GgufArch{"qwen3", false};
  }
  if (c.qkv_bias && !c.o_bias) return GgufArch{"qwen2", false};
  return GgufArch{"llama", true};
}

void add_hyper_parameters(GgufMetadata& m, const LlamaConfig& c, const std::string& arch, GgufDType dtype) {
  const auto key = [&](const char* k) { return fmt::format("{}.{}", arch, k); };
  m.add_string("general.architecture", arch);
  m.add_string("general.name", "foldpar");
  m.add_u32("general.file_type", file_type(dtype));
  m.add_u32(key("context_length"), static_cast<uint32_t>(c.max_position_embeddings));
  m.add_u32(key("embedding_length"), static_cast<uint32_t>(c.hidden_size));
  m.add_u32(key("block_count"), static_cast<uint32_t>(c.num_hidden_layers));
  m.add_u32(key("feed_forward_length"), static_cast<uint32_t>(c.intermediate_size));
  m.add_u32(key("attention.head_count"), static_cast<uint32_t>(c.num_attention_heads));
  m.add_u32(key("attention.head_count_kv"), static_cast<uint32_t>(c.num_key_value_heads));
  m.add_f32(key("rope.freq_base"), static_cast<float>(c.rope_theta));
  m.add_f32(key("attention.layer_norm_rms_epsilon"), static_cast<float>(c.rms_norm_eps));
  m.add_u32(key("rope.dimension_count"), static_cast<uint32_t>(c.head_dim()));
  if (c.q_dim() != c.hidden_size) {  // llama.cpp assumes n_embd / n_head otherwise
    m.add_u32(key("attention.key_length"), static_cast<uint32_t>(c.head_dim()));
    m.add_u32(key("attention.value_length"), static_cast<uint32_t>(c.head_dim()));
  }
  m.add_u32(key("vocab_size"), static_cast<uint32_t>(c.vocab_size));
}

void add_vocab(GgufMetadata& m, const GgufVocab& v) {
  m.add_string("tokenizer.ggml.model", v.model);
  m.add_string("tokenizer.ggml.pre", v.pre);
  m.add_string_array("tokenizer.ggml.tokens", v.tokens);
  m.add_i32_array("tokenizer.ggml.token_type", v.token_types);
  if (!v.scores.empty()) m.add_f32_array("tokenizer.ggml.scores", v.scores);
  if (v.model == "gpt2") m.add_string_array("tokenizer.ggml.merges", v.merges);
  if (v.bos_id >= 0) m.add_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(v.bos_id));
  if (v.eos_id >= 0) m.add_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(v.eos_id));
  m.add_bool("tokenizer.ggml.add_bos_token", v.add_bos);
  m.add_bool("tokenizer.ggml.add_eos_token", false);
}

std::span<const float> values_of(const Tensor& t) { return {t.data<float>(), static_cast<size_t>(t.numel())}; }

std::vector<int64_t> shape_of(const Tensor& t) { return std::vector<int64_t>(t.shape().begin(), t.shape().end()); }

}  // namespace

std::string byte_level_char(uint8_t byte) {
  if (printable_byte(byte)) return utf8(byte);
  uint32_t n = 0;  // the rank of `byte` among the non-printable bytes
  for (uint32_t b = 0; b < byte; ++b)
    if (!printable_byte(b)) ++n;
  return utf8(256 + n);
}

Result<GgufVocab> byte_tokenizer_vocab(int64_t vocab_size) {
  if (vocab_size < 256)
    return invalid_argument("the byte tokenizer needs a vocabulary of at least 256, the model has {}", vocab_size);
  GgufVocab v;
  v.model = "gpt2";
  for (int b = 0; b < 256; ++b) {
    v.tokens.push_back(byte_level_char(static_cast<uint8_t>(b)));
    v.token_types.push_back(1);
  }
  for (int64_t id = 256; id < vocab_size; ++id) {
    v.tokens.push_back(fmt::format("<|unused_{}|>", id));
    v.token_types.push_back(5);
  }
  if (vocab_size > 256) v.bos_id = v.eos_id = 256;
  return v;
}

Result<std::string> llama_cpp_pre_tokenizer(const std::string& split_regex) {
  // The two regexes differ in digits: Llama 3 groups up to three, Qwen splits each one.
  static const std::string kLlama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static const std::string kQwen2 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  if (split_regex == kLlama3) return std::string("llama-bpe");
  if (split_regex == kQwen2) return std::string("qwen2");
  return invalid_argument("GGUF export: the Split regex {} is not one llama.cpp names (Llama 3's or Qwen2's)",
                          split_regex.substr(0, 80));
}

Result<GgufDType> gguf_dtype_from_name(const std::string& name) {
  if (name == "f32") return GgufDType::kF32;
  if (name == "f16") return GgufDType::kF16;
  if (name == "bf16") return GgufDType::kBF16;
  return invalid_argument("unknown GGUF dtype '{}' (f32, f16 or bf16)", name);
}

std::vector<float> permute_rows_for_gguf_rope(const Tensor& w, int64_t n_heads, int64_t head_dim) {
  const int64_t cols = w.numel() / w.dim(0), half = head_dim / 2;
  FP_CHECK(w.dim(0) == n_heads * head_dim && head_dim % 2 == 0, "{} rows for {} heads of {}", w.dim(0), n_heads,
           head_dim);
  const float* src = w.data<float>();
  std::vector<float> out(static_cast<size_t>(w.numel()));
  for (int64_t h = 0; h < n_heads; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t j = 0; j < 2; ++j) {
        const float* from = src + (h * head_dim + j * half + i) * cols;
        std::copy(from, from + cols, out.data() + (h * head_dim + 2 * i + j) * cols);
      }
  return out;
}

Status write_gguf_model(const std::string& path, const LlamaConfig& c, const LlamaWeights& w, const GgufVocab& vocab,
                        GgufDType dtype) {
  // llama.cpp carries RoPE scaling in keys and a rope_freqs tensor this writer does not emit.
  if (c.rope_scaling.enabled())
    return unimplemented("GGUF export: rope_scaling type {} is not exported (llama.cpp would rotate unscaled)",
                         rope_type_name(c.rope_scaling.type));
  if (c.moe.enabled())
    return unimplemented("GGUF export of a mixture-of-experts model ({}) is not supported", c.moe.model_type());
  // The llama architecture of llama.cpp attends over the whole causal context: a windowed
  // model written as it would generate differently from foldpar without a word.
  if (c.sliding_window > 0)
    return unimplemented("GGUF export of a sliding window (sliding_window {}) is not supported", c.sliding_window);
  if (static_cast<int64_t>(vocab.tokens.size()) != c.vocab_size || vocab.token_types.size() != vocab.tokens.size())
    return invalid_argument("the GGUF vocabulary has {} tokens ({} types), the model {}", vocab.tokens.size(),
                            vocab.token_types.size(), c.vocab_size);
  FP_ASSIGN_OR_RETURN(GgufArch arch, gguf_architecture(c));
  GgufMetadata meta;
  add_hyper_parameters(meta, c, arch.name, dtype);
  add_vocab(meta, vocab);
  const GgufTensorType mt = matrix_type(dtype);
  std::vector<GgufTensor> tensors;
  std::vector<std::vector<float>> permuted;  // owns the reordered q and k rows (and biases)
  permuted.reserve(4 * w.layers.size());
  auto matrix = [&](std::string name, const Tensor& t) { tensors.push_back({std::move(name), shape_of(t), mt, values_of(t)}); };
  auto f32_vector = [&](std::string name, const Tensor& t) {  // norm gains and biases: f32 whatever dtype
    if (t.defined()) tensors.push_back({std::move(name), shape_of(t), GgufTensorType::kF32, values_of(t)});
  };
  // q or k weight (type mt) or bias (f32) of n heads, rows permuted for the llama architecture.
  auto rope_rows = [&](std::string name, const Tensor& t, int64_t n, GgufTensorType type) {
    if (!t.defined()) return;
    if (!arch.permute_qk) {
      tensors.push_back({std::move(name), shape_of(t), type, values_of(t)});
      return;
    }
    permuted.push_back(permute_rows_for_gguf_rope(t, n, c.head_dim()));
    tensors.push_back({std::move(name), shape_of(t), type, permuted.back()});
  };
  matrix("token_embd.weight", w.embed);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = fmt::format("blk.{}.", l);
    f32_vector(p + "attn_norm.weight", L.attn_norm);
    rope_rows(p + "attn_q.weight", L.wq, c.num_attention_heads, mt);
    rope_rows(p + "attn_k.weight", L.wk, c.num_key_value_heads, mt);
    matrix(p + "attn_v.weight", L.wv);
    matrix(p + "attn_output.weight", L.wo);
    rope_rows(p + "attn_q.bias", L.bq, c.num_attention_heads, GgufTensorType::kF32);
    rope_rows(p + "attn_k.bias", L.bk, c.num_key_value_heads, GgufTensorType::kF32);
    f32_vector(p + "attn_v.bias", L.bv);
    f32_vector(p + "attn_output.bias", L.bo);
    f32_vector(p + "attn_q_norm.weight", L.q_norm);  // qwen3 only, [d] in its own (Hugging Face) order
    f32_vector(p + "attn_k_norm.weight", L.k_norm);
    f32_vector(p + "ffn_norm.weight", L.mlp_norm);
    matrix(p + "ffn_gate.weight", L.w_gate);
    matrix(p + "ffn_up.weight", L.w_up);
    matrix(p + "ffn_down.weight", L.w_down);
    f32_vector(p + "ffn_gate.bias", L.b_gate);
    f32_vector(p + "ffn_up.bias", L.b_up);
    f32_vector(p + "ffn_down.bias", L.b_down);
  }
  f32_vector("output_norm.weight", w.final_norm);
  if (!w.tied) matrix("output.weight", w.lm_head);
  return write_gguf(path, meta, tensors);
}

}  // namespace foldpar
