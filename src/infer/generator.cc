// The generation loop: prefill, then sample / broadcast / decode until every sequence stops.
#include "infer/generator.h"

#include <algorithm>
#include <chrono>

#include "infer/completion_text.h"

namespace foldpar {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Status validate(const GenerationOptions& o) {
  if (o.max_new_tokens <= 0) return invalid_argument("--max-new-tokens ({}) must be positive", o.max_new_tokens);
  if (o.batch < 0) return invalid_argument("--batch ({}) must be 0 (every prompt at once) or positive", o.batch);
  return o.sampling.validate();
}

// Rank 0's view of one batch: the text of every sequence and whether it has finished.
struct BatchState {
  int64_t first = 0;  // prompt index of sequence 0
  std::vector<CompletionText> texts;
  std::vector<bool> done;
};

// Rank 0: the next token of every unfinished sequence of [b0, b0 + n) (logits: their rows
// [n, V]), streamed and checked for its end. Fills tokens[0, n) (0 for finished sequences);
// returns whether every sequence of the batch has finished.
bool choose_group(BatchState& st, Backend& be, const Tensor& logits, int64_t b0, const GenerationOptions& o,
                  const std::vector<std::string>& prompts, const GenerationCallbacks& cb, std::span<int32_t> tokens,
                  GenerationReport& report) {
  const int64_t n = logits.dim(0), V = logits.dim(1);
  // Sampling runs on the host: the logits come out through the backend.
  std::vector<float> host(static_cast<size_t>(logits.numel()));
  be.copy_to_host(logits, std::as_writable_bytes(std::span<float>(host)));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t b = b0 + j;
    const size_t i = static_cast<size_t>(b);
    tokens[static_cast<size_t>(j)] = 0;
    if (st.done[i]) continue;
    CompletionText& text = st.texts[i];
    const std::span<const float> row(host.data() + j * V, static_cast<size_t>(V));
    const int64_t step = static_cast<int64_t>(text.tokens().size());
    int32_t& token = tokens[static_cast<size_t>(j)];
    token = sample_token(row, o.sampling, static_cast<uint64_t>(st.first + b), static_cast<uint64_t>(step));
    ++report.generated_tokens;
    const bool stopped = text.add(token);
    st.done[i] = stopped || static_cast<int64_t>(text.tokens().size()) >= o.max_new_tokens;
    const std::string piece = text.take_ready(st.done[i]);
    if (!piece.empty() && cb.on_text) cb.on_text(st.first + b, piece);
    if (st.done[i]) {
      Completion c{prompts[static_cast<size_t>(st.first + b)], text.text(), text.tokens(), stopped ? "stop" : "length"};
      if (cb.on_done) cb.on_done(st.first + b, c);
      report.completions[static_cast<size_t>(st.first + b)] = std::move(c);
    }
  }
  return std::all_of(st.done.begin(), st.done.end(), [](bool d) { return d; });
}

// Rank 0: choose_group over the whole batch; tokens[B] = 1 once all have finished.
void choose_tokens(BatchState& st, Backend& be, const Tensor& logits, const GenerationOptions& o,
                   const std::vector<std::string>& prompts, const GenerationCallbacks& cb, std::vector<int32_t>& tokens,
                   GenerationReport& report) {
  const size_t B = st.texts.size();
  const bool all_done = choose_group(st, be, logits, 0, o, prompts, cb, std::span<int32_t>(tokens.data(), B), report);
  tokens[B] = all_done ? 1 : 0;
}

Status run_batch(ShardedDecoder& decoder, Backend& be, const Tokenizer& tokenizer, const std::vector<std::string>& prompts,
                 int64_t first, int64_t count, const GenerationOptions& o, Communicator& world,
                 const GenerationCallbacks& cb, GenerationReport& report) {
  std::vector<std::vector<int32_t>> ids;
  BatchState st{first, {}, std::vector<bool>(static_cast<size_t>(count), false)};
  for (int64_t i = first; i < first + count; ++i) {
    ids.push_back(tokenizer.encode(prompts[static_cast<size_t>(i)]));
    if (ids.back().empty()) return invalid_argument("prompt {} is empty", i);
    report.prompt_tokens += static_cast<int64_t>(ids.back().size());
    st.texts.emplace_back(tokenizer, o.stop);
  }
  auto t0 = std::chrono::steady_clock::now();
  FP_ASSIGN_OR_RETURN(Tensor logits, decoder.prefill(be, ids, o.max_new_tokens));
  report.prefill_seconds += seconds_since(t0);
  report.cache_bytes = std::max(report.cache_bytes, decoder.cache().bytes());
  t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> tokens(static_cast<size_t>(count) + 1);
  if (o.in_flight && decoder.decodes_in_flight(count)) {
    // The first tokens as below; then the decoder's loop, rank 0 choosing inside it.
    if (world.rank() == 0) choose_tokens(st, be, logits, o, prompts, cb, tokens, report);
    FP_CHECK_OK(world.broadcast(tokens.data(), tokens.size(), DType::kI32, 0));
    if (tokens.back() == 0) {
      ShardedDecoder::GroupChooser choose;
      if (world.rank() == 0)
        choose = [&](int64_t b0, const Tensor& rows, std::span<int32_t> out) {
          return choose_group(st, be, rows, b0, o, prompts, cb, out, report);
        };
      FP_ASSIGN_OR_RETURN(const int64_t rows, decoder.decode_in_flight(
                                                  be, std::span<const int32_t>(tokens.data(), static_cast<size_t>(count)),
                                                  choose));
      report.decode_tokens += rows;
    }
    report.decode_seconds += seconds_since(t0);
    return Status();
  }
  for (;;) {
    if (world.rank() == 0) choose_tokens(st, be, logits, o, prompts, cb, tokens, report);
    FP_CHECK_OK(world.broadcast(tokens.data(), tokens.size(), DType::kI32, 0));
    if (tokens.back() != 0) break;
    FP_ASSIGN_OR_RETURN(logits, decoder.decode(be, std::span<const int32_t>(tokens.data(), static_cast<size_t>(count))));
    report.decode_tokens += count;
  }
  report.decode_seconds += seconds_since(t0);
  return Status();
}

}  // namespace

Result<GenerationReport> generate(ShardedDecoder& decoder, Backend& be, const Tokenizer& tokenizer,
                                  const std::vector<std::string>& prompts, const GenerationOptions& o,
                                  Communicator& world, const GenerationCallbacks& cb) {
  FP_RETURN_IF_ERROR(validate(o));
  if (prompts.empty()) return invalid_argument("no prompts to generate from");
  GenerationReport report;
  report.completions.resize(prompts.size());
  const int64_t n = static_cast<int64_t>(prompts.size()), batch = o.batch > 0 ? std::min(o.batch, n) : n;
  for (int64_t first = 0; first < n; first += batch)
    FP_RETURN_IF_ERROR(run_batch(decoder, be, tokenizer, prompts, first, std::min(batch, n - first), o, world, cb, report));
  if (world.rank() != 0) report.completions.clear();
  return report;
}

}  // namespace foldpar
