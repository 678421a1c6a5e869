// A Llama-family model as a GGUF file llama.cpp loads: the hyper-parameters under ARCH.*,
// the tensors under llama.cpp's names, and the vocabulary under tokenizer.ggml.*. ARCH is
// "qwen3" with per-head q/k norms, "qwen2" with q/k/v biases and no o_proj bias, else
// "llama" (which also reads Llama's attention_bias and mlp_bias). Conventions that differ
// from the Hugging Face layout foldpar keeps:
//  - RoPE: foldpar (as Hugging Face) rotates the pairs (i, i + d/2) of each head by angle
//    i; so do llama.cpp's qwen2 and qwen3 (its NeoX rotation), whose rows are written as
//    they are. Its "llama" architecture rotates the adjacent pairs (2i, 2i + 1), so within
//    each head the rows of q_proj and k_proj (weights and biases) are reordered: file row
//    2i + j holds HF row j * d/2 + i (j = 0, 1), which makes q.k identical under either.
//  - Biases and norm gains are f32 tensors whatever the matrices' dtype.
//  - Tied embeddings: output.weight is left out; llama.cpp then uses token_embd.weight.
// Not collective; the caller runs it on one rank with full weights.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "io/gguf_write.h"
#include "model/llama_config.h"
#include "model/llama_weights.h"

namespace foldpar {

// The vocabulary as llama.cpp reads it (tokenizer.ggml.*).
struct GgufVocab {
  std::string model;                 // "gpt2" (byte-level BPE) or "llama" (SentencePiece)
  std::string pre = "default";       // tokenizer.ggml.pre
  std::vector<std::string> tokens;   // one per id, exactly vocab_size of them
  std::vector<int32_t> token_types;  // 1 normal, 2 unknown, 3 control, 5 unused, 6 byte
  std::vector<float> scores;         // "llama" only
  std::vector<std::string> merges;   // "gpt2" only ("a b" per merge; may be empty)
  int64_t bos_id = -1, eos_id = -1;  // -1: not written (llama.cpp then picks its default)
  bool add_bos = false;
};

// foldpar's byte tokenizer (id b < 256 is byte b) as a byte-level BPE vocabulary without
// merges: id b's text is GPT-2's printable stand-in for byte b, so llama.cpp encodes every
// byte of a prompt to its own id and decodes ids back to the bytes. Ids from 256 up to
// vocab_size are unused tokens "<|unused_N|>"; the first of them, when there is one, is
// written as bos and eos (the byte tokenizer has none, and llama.cpp needs an id; with
// vocab_size 256 llama.cpp falls back to its default, id 11, so pass ignore_eos there).
// invalid_argument when vocab_size < 256.
Result<GgufVocab> byte_tokenizer_vocab(int64_t vocab_size);

// llama.cpp's name (tokenizer.ggml.pre) for the Split regex of a byte-level BPE tokenizer:
// "llama-bpe" for Llama 3's, "qwen2" for Qwen2's and Qwen3's; invalid_argument for others
// (llama.cpp would split them with its default regex and tokenize differently).
Result<std::string> llama_cpp_pre_tokenizer(const std::string& split_regex);

// GPT-2's map of a byte to the printable code point that stands for it, as UTF-8.
std::string byte_level_char(uint8_t byte);

enum class GgufDType { kF32, kF16, kBF16 };  // of the matrices; 1-D norm gains are always f32
Result<GgufDType> gguf_dtype_from_name(const std::string& name);  // "f32", "f16", "bf16"

// Rows of one projection [n_heads * d, h] or its bias [n_heads * d] reordered per head for
// the RoPE of llama.cpp's llama architecture (above).
std::vector<float> permute_rows_for_gguf_rope(const Tensor& w, int64_t n_heads, int64_t head_dim);

// Writes `weights` (f32, full) of `config` to `path`.
Status write_gguf_model(const std::string& path, const LlamaConfig& config, const LlamaWeights& weights,
                        const GgufVocab& vocab, GgufDType dtype);

}  // namespace foldpar
