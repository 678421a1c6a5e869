// llama.cpp's side of tests/e2e/gguf_export.sh: loads a GGUF file with @fugood/llama.node and
// generates greedily. Usage: node gguf_llama_cpp.js MODULE_DIR MODEL N PROMPT...
// Prints one line per prompt, "RESULT " and then JSON (llama.node logs to stdout too): {"prompt_ids": [...], "ids": [...N generated ids...]}.
// The ids are read from the session file llama.cpp saves (its evaluated tokens: the prompt,
// then each generated token but the last), so they are exact, where the completion's text
// would lose bytes that are not UTF-8; hence N + 1 tokens are generated.
'use strict';
const fs = require('fs');
const os = require('os');
const path = require('path');

async function generate(loadModel, model, n, prompt, session) {
  // f32 K/V cache and no flash attention: llama.cpp's default f16 cache rounds K and V, which
  // can flip a greedy choice between near-equal logits of a random model.
  const ctx = await loadModel({ model, n_ctx: 512, n_batch: 512, n_threads: 1, n_gpu_layers: 0,
    cache_type_k: 'f32', cache_type_v: 'f32', flash_attn_type: 'off', use_mmap: false });
  try {
    const promptIds = Array.from((await ctx.tokenize(prompt)).tokens);
    const r = await ctx.completion({ prompt, n_predict: n + 1, temperature: 0, top_k: 1, ignore_eos: true });
    await ctx.saveSession(session);
    const b = fs.readFileSync(session);
    if (b.toString('latin1', 0, 4) !== 'nsgg') throw new Error(`${session} is not a llama.cpp session file`);
    const count = b.readUInt32LE(8);
    const ids = [];
    for (let i = 0; i < count; i++) ids.push(b.readInt32LE(12 + 4 * i));
    const evaluatedPrompt = ids.slice(0, promptIds.length);
    if (JSON.stringify(evaluatedPrompt) !== JSON.stringify(promptIds))
      throw new Error(`the session starts ${evaluatedPrompt}, not the prompt ${promptIds}`);
    if (count < promptIds.length + n)
      throw new Error(`llama.cpp evaluated ${count} tokens, fewer than the prompt's ${promptIds.length} and ${n} more (${r.tokens_predicted} predicted)`);
    return { prompt_ids: promptIds, ids: ids.slice(promptIds.length, promptIds.length + n) };
  } finally {
    await ctx.release();
  }
}

(async () => {
  const [moduleDir, model, n, ...prompts] = process.argv.slice(2);
  const { loadModel } = require(moduleDir);
  const session = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'gguf-')), 'session.bin');
  for (const p of prompts) console.log('RESULT ' + JSON.stringify(await generate(loadModel, model, Number(n), p, session)));
})().catch((e) => {
  console.error(`gguf_llama_cpp.js: ${e.message}`);
  process.exit(1);
});
