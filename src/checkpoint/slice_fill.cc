// Loading by global blocks (slice_fill.h).
#include "checkpoint/slice_fill.h"

#include <algorithm>

namespace foldpar {

Status fill_slices(const std::string& what, const char* kind, const std::vector<ParamRef>& params,
                   const std::vector<Tensor*>& targets, std::vector<SafetensorsFile>& files, BlockIndex& index) {
  for (size_t i = 0; i < params.size(); ++i) {
    // Filled on the host, stored with one host copy (the target may be device memory).
    FP_CHECK(targets[i]->dtype() == DType::kF32, "checkpoint target {}", targets[i]->describe());
    std::vector<float> host = read_host_f32(*targets[i]);
    float* dst = host.data();
    for (const GlobalSlice& s : params[i].slices) {
      int64_t filled = 0;
      for (const StoredBlock& b : index[{kind, s.tensor}]) {
        const int64_t r0 = std::max(s.row0, b.box.row0), r1 = std::min(s.row0 + s.rows, b.box.row0 + b.box.rows);
        const int64_t c0 = std::max(s.col0, b.box.col0), c1 = std::min(s.col0 + s.cols, b.box.col0 + b.box.cols);
        if (r0 >= r1 || c0 >= c1) continue;
        FP_ASSIGN_OR_RETURN(Tensor block, files[b.file].read_as(b.name, DType::kF32, MemCategory::kWorkspace));
        const std::vector<float> values = read_host_f32(block);
        const float* src = values.data();
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) {
            const int64_t li = s.transposed ? (c - s.col0) * s.rows + (r - s.row0) : (r - s.row0) * s.cols + (c - s.col0);
            dst[s.offset + li] = src[(r - b.box.row0) * b.box.cols + (c - b.box.col0)];
          }
        filled += (r1 - r0) * (c1 - c0);
      }
      if (filled != s.rows * s.cols)
        return corrupt("{}: {} of {} [{}+{}, {}+{}] covers {} of {} elements", what, kind, s.tensor, s.row0, s.rows,
                       s.col0, s.cols, filled, s.rows * s.cols);
    }
    write_host_f32(host, *targets[i]);
  }
  return Status();
}


std::vector<Tensor*> tensors_of(std::vector<ParamRef>& params) {
  std::vector<Tensor*> t;
  for (ParamRef& p : params) t.push_back(&p.param);
  return t;
}

std::vector<Tensor*> tensors_of(std::vector<Tensor>& list) {
  std::vector<Tensor*> t;
  for (Tensor& x : list) t.push_back(&x);
  return t;
}

Status same_config(const LlamaConfig& a, const LlamaConfig& b) {
  if (a.hidden_size != b.hidden_size || a.intermediate_size != b.intermediate_size ||
      a.num_attention_heads != b.num_attention_heads || a.num_key_value_heads != b.num_key_value_heads ||
      a.num_hidden_layers != b.num_hidden_layers || a.vocab_size != b.vocab_size ||
      a.tie_word_embeddings != b.tie_word_embeddings)
    return invalid_argument("the checkpoint's model ({}) differs from this model ({})", a.to_json(), b.to_json());
  return Status();
}

}  // namespace foldpar
