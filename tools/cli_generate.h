// `foldpar generate`: its flags, its output and its run. Included by main.cc only, so that
// CLI11 stays in one translation unit. What generation does lives in src/app/generate.h and
// src/infer/; here: flags in, text out.
//
// Output (rank 0): with one prompt, the completion streams to stdout as it is generated;
// with several, each completion is printed when it finishes, after a header line
// "--- completion I (N tokens, stop|length) ---"; with --json, one JSON object per completion
// per line instead. The summary (layout, prefill and decode tokens/s, KV cache per rank) goes
// to stderr.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "app/generate.h"
#include "comm/mpi_runtime.h"
#include "cli_layout.h"
#include "core/status.h"
#include "device.h"

namespace foldpar::cli {

struct GenerateArgs {
  std::string checkpoint, hf, tokenizer = "bytes", prompt_file, device = "cpu";
  LayoutArgs layout;
  std::vector<std::string> prompts, stops;
  int64_t max_new_tokens = 128, batch = 0, top_k = 0;
  double temperature = 0, top_p = 1.0;
  uint64_t seed = 0;
  bool json = false;
};

inline CLI::App* add_generate(CLI::App& app, GenerateArgs& a) {
  CLI::App* cmd = app.add_subcommand("generate", "generate text from a checkpoint or a Hugging Face directory (run under mpirun)");
  cmd->add_option("--checkpoint", a.checkpoint, "a checkpoint (step-N), or a directory holding them: the newest");
  cmd->add_option("--hf", a.hf, "or: a Hugging Face directory (config.json + model.safetensors)");
  add_layout_flags(cmd, a.layout, /*generation=*/true);
  cmd->add_option("--prompt-file", a.prompt_file, "prompts, one per line (or *.jsonl: a JSON string or {\"prompt\": ...} per line)");
  cmd->add_option("--prompt", a.prompts, "a prompt (repeatable; after those of --prompt-file)");
  cmd->add_option("--max-new-tokens", a.max_new_tokens, "tokens generated per prompt at most");
  cmd->add_option("--temperature", a.temperature, "0: greedy; > 0: sample from softmax(logits / temperature)");
  cmd->add_option("--top-k", a.top_k, "sample among the k most likely tokens (0: all)");
  cmd->add_option("--top-p", a.top_p, "sample among the most likely tokens whose probability reaches p (1: all)");
  cmd->add_option("--seed", a.seed, "seed of the sampling");
  cmd->add_option("--stop", a.stops, "stop sequence (repeatable; \\n, \\t and \\\\ are escapes); not printed");
  cmd->add_option("--batch", a.batch, "prompts decoded together (0: all)");
  cmd->add_option("--tokenizer", a.tokenizer, "bytes, or a SentencePiece model file");
  cmd->add_flag("--json", a.json, "one JSON object per completion per line");
  cmd->add_option("--device", a.device, "cpu or cuda (each rank: GPU local rank mod GPUs; docs/GPU.md)");
  return cmd;
}

// "\n", "\t", "\\" in a stop sequence given on the command line.
inline std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out.push_back(s[i]);
      continue;
    }
    const char c = s[++i];
    out.push_back(c == 'n' ? '\n' : c == 't' ? '\t' : c);
  }
  return out;
}

// `ranks`: the job's, for the default layout tsp=<ranks>.
inline Result<GenerateOptions> generate_options(const GenerateArgs& a, int ranks) {
  GenerateOptions o;
  o.checkpoint = a.checkpoint;
  o.hf_dir = a.hf;
  FP_ASSIGN_OR_RETURN(o.layout, layout_of(a.layout, ranks));
  o.tokenizer = a.tokenizer;
  if (!a.prompt_file.empty()) {
    FP_ASSIGN_OR_RETURN(o.prompts, read_prompt_file(a.prompt_file));
  }
  o.prompts.insert(o.prompts.end(), a.prompts.begin(), a.prompts.end());
  if (o.prompts.empty()) return invalid_argument("no prompt: give --prompt-file or --prompt");
  o.generation.max_new_tokens = a.max_new_tokens;
  o.generation.batch = a.batch;
  o.generation.sampling = SamplingOptions{a.temperature, a.top_k, a.top_p, a.seed};
  for (const std::string& s : a.stops) o.generation.stop.push_back(unescape(s));
  return o;
}

inline GenerationCallbacks print_callbacks(const GenerateArgs& a, size_t prompts) {
  GenerationCallbacks cb;
  if (a.json) {
    cb.on_done = [](int64_t i, const Completion& c) {
      const nlohmann::json j{{"index", i}, {"prompt", c.prompt}, {"completion", c.text},
                             {"tokens", c.tokens.size()}, {"stop_reason", c.stop_reason}};
      std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
      std::fflush(stdout);
    };
  } else if (prompts == 1) {
    cb.on_text = [](int64_t, std::string_view piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    };
    cb.on_done = [](int64_t, const Completion&) { std::printf("\n"); };
  } else {
    cb.on_done = [](int64_t i, const Completion& c) {
      std::printf("--- completion %lld (%zu tokens, %s) ---\n%s\n", static_cast<long long>(i), c.tokens.size(),
                  c.stop_reason.c_str(), c.text.c_str());
      std::fflush(stdout);
    };
  }
  return cb;
}

// Returns the exit code; `fail` prints a Status once per job and returns 2.
inline int run_generate(const GenerateArgs& a, int (*fail)(const Status&)) {
  Result<DeviceKind> kind = parse_device(a.device);
  if (!kind.ok()) return fail(kind.status());
  Result<CommOptions> comm_options = CommOptions::from_env();
  if (!comm_options.ok()) return fail(comm_options.status());
  MpiRuntime mpi(nullptr, nullptr, comm_options.value());
  Result<GenerateOptions> o = generate_options(a, mpi.world().size());
  if (!o.ok()) return fail(o.status());
  Result<Device> device = open_job_device(*kind, mpi);  // before the first tensor
  if (!device.ok()) return fail(device.status());
  o->backend = device->backend.get();
  o->axis_comm = device->axis_comm;
  const bool root = mpi.world().rank() == 0;
  Result<GenerateResult> r = foldpar::run_generate(*o, mpi.world(), print_callbacks(a, o->prompts.size()));
  if (!r.ok()) return fail(r.status());
  if (root) {
    const GenerationReport& g = r->report;
    std::fprintf(stderr,
                 "foldpar generate: %s, %zu prompts from %s\n"
                 "  prefill %lld tokens in %.3f s: %.1f tokens/s\n"
                 "  decode  %lld tokens in %.3f s: %.1f tokens/s (every slot of every step)\n"
                 "  generated %lld tokens: %.1f tokens/s over prefill and decode\n"
                 "  KV cache %.2f MiB per rank\n",
                 r->layout.c_str(), o->prompts.size(), r->source.c_str(), static_cast<long long>(g.prompt_tokens),
                 g.prefill_seconds, g.prefill_tokens_per_second(), static_cast<long long>(g.decode_tokens),
                 g.decode_seconds, g.decode_tokens_per_second(), static_cast<long long>(g.generated_tokens),
                 g.generated_tokens_per_second(), static_cast<double>(g.cache_bytes) / (1 << 20));
  }
  return 0;
}

}  // namespace foldpar::cli
