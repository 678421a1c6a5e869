// The independent side of tests/unit/hf_tokenizer_oracle_test.cc: encodes and decodes
// every record of a corpus with @lenml/tokenizers (a JavaScript port of Hugging Face's
// tokenizers) and writes, per tokenizer, one JSON line per record:
//   {"ids": [...], "decoded": "...", "nfc": true|false}
// Usage: node encode.mjs NPM_DIR CORPUS.json OUT_DIR NAME=TOKENIZER.json ...
// tokenizer_config.json beside each tokenizer.json is read when present.
import { createRequire } from "node:module";
import fs from "node:fs";
import path from "node:path";

const [npmDir, corpusPath, outDir, ...specs] = process.argv.slice(2);
const require = createRequire(path.join(path.resolve(npmDir), "package.json"));
const { TokenizerLoader } = require("@lenml/tokenizers");
const corpus = JSON.parse(fs.readFileSync(corpusPath, "utf8"));
for (const spec of specs) {
  const eq = spec.indexOf("=");
  const name = spec.slice(0, eq), file = spec.slice(eq + 1);
  const configPath = path.join(path.dirname(file), "tokenizer_config.json");
  const tokenizerJSON = JSON.parse(fs.readFileSync(file, "utf8"));
  const tokenizerConfig = fs.existsSync(configPath) ? JSON.parse(fs.readFileSync(configPath, "utf8")) : {};
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
  const lines = [];
  for (const text of corpus) {
    const ids = tok.encode(text, { add_special_tokens: false });
    const decoded = tok.decode(ids, { skip_special_tokens: false, clean_up_tokenization_spaces: false });
    lines.push(JSON.stringify({ ids, decoded, nfc: text === text.normalize("NFC") }));
  }
  fs.writeFileSync(path.join(outDir, `${name}.jsonl`), lines.join("\n") + "\n");
}
