#!/usr/bin/python3
"""Checks for tests/e2e/gguf_export.sh, with a GGUF reader of its own (from the format's
published description, independent of foldpar's writer).

  gguf_check.py tensors FILE HF_DIR DTYPE   every tensor and hyper-parameter of FILE against the
                                            Hugging Face directory it was exported from
  gguf_check.py compare bytes|TOKENIZER FOLDPAR_JSONL FOLDPAR_STDERR LLAMA_OUT PROMPT...
                                            foldpar generate --json against gguf_llama_cpp.js:
                                            the same generated ids, as many prompt tokens as
                                            foldpar prefilled (bytes: the prompts' bytes)
  gguf_check.py random CONFIG HF_DIR SEED     a Hugging Face directory with random weights
                                            (std 0.02, q/k 0.12, q/k norm gains 3: attention far from uniform;
                                            qwen2's q/k/v biases, qwen3's q/k norms) for
                                            vocabularies too large for verify --dump's pace
  gguf_check.py sharpen HF_DIR FACTOR       multiplies q_proj, k_proj (and q/k norm gains) by FACTOR in place, so
                                            that a random model's attention is far from uniform
                                            (at init it barely depends on positions, and a wrong
                                            RoPE row order would go unseen)
Exits 1 naming the first difference."""
import json
import re
import struct
import sys

import numpy as np

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
GGML = {0: ("f32", np.float32), 1: ("f16", np.float16), 30: ("bf16", np.uint16)}


class Reader:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self):
        n = self.take("<Q")
        s = self.data[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, t):
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.take("<I"), self.take("<Q")
            return [self.value(et) for _ in range(n)]
        return self.take(SCALARS[t])


def read_gguf(path):
    data = open(path, "rb").read()
    r = Reader(data)
    if data[:4] != b"GGUF":
        raise SystemExit(f"{path}: magic {data[:4]!r}, not GGUF")
    r.pos = 4
    version, n_tensors, n_kv = r.take("<I"), r.take("<Q"), r.take("<Q")
    if version != 3:
        raise SystemExit(f"{path}: version {version}, not 3")
    meta = {}
    for _ in range(n_kv):
        k = r.string()
        meta[k] = r.value(r.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.take("<Q") for _ in range(r.take("<I"))]
        infos.append((name, dims, r.take("<I"), r.take("<Q")))
    align = meta.get("general.alignment", 32)
    start = (r.pos + align - 1) // align * align
    tensors = {}
    for name, dims, t, off in infos:
        if off % align:
            raise SystemExit(f"{path}: tensor {name} at offset {off}, not a multiple of {align}")
        kind, dt = GGML[t]
        n = int(np.prod(dims))
        a = np.frombuffer(data, dtype=dt, count=n, offset=start + off).reshape(list(reversed(dims)))
        tensors[name] = (kind, a)
    return meta, tensors


def read_safetensors(path):
    data = open(path, "rb").read()
    n = struct.unpack_from("<Q", data, 0)[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        assert v["dtype"] == "F32", v["dtype"]
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(data[8 + n + a:8 + n + b], dtype=np.float32).reshape(v["shape"])
    return out


def to_llama_rope_rows(w, n_head):
    # HF rotates (i, i + d/2) of each head; llama.cpp's "llama" architecture the adjacent pairs
    # (2i, 2i + 1): row 2i + j of a head takes HF row j * d/2 + i (a bias [n*d] likewise).
    cols = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *cols).swapaxes(1, 2).reshape(w.shape)


def architecture(cfg):
    # The llama.cpp architecture foldpar writes (checkpoint/gguf_export.h): qwen2 and qwen3 rotate
    # the halves of each head like Hugging Face (rows kept), llama adjacent pairs (rows permuted).
    t = cfg.get("model_type", "llama")
    return t if t in ("qwen2", "qwen3") else "llama"


def rounded(a, dtype):
    if dtype == "f32":
        return a
    if dtype == "f16":
        return a.astype(np.float16)
    u = a.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def check_tensors(gguf, hf_dir, dtype):
    meta, tensors = read_gguf(gguf)
    cfg = json.load(open(f"{hf_dir}/config.json"))
    st = read_safetensors(f"{hf_dir}/model.safetensors")
    h, n_h, n_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    arch = architecture(cfg)
    d = cfg.get("head_dim") or h // n_h
    want_meta = {
        "general.architecture": arch, "context_length": cfg["max_position_embeddings"],
        "embedding_length": h, "block_count": cfg["num_hidden_layers"],
        "feed_forward_length": cfg["intermediate_size"], "attention.head_count": n_h,
        "attention.head_count_kv": n_kv, "rope.dimension_count": d,
        "vocab_size": cfg["vocab_size"], "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.add_bos_token": False,
        "rope.freq_base": np.float32(cfg["rope_theta"]),
        "attention.layer_norm_rms_epsilon": np.float32(cfg["rms_norm_eps"]),
    }
    if n_h * d != h:
        want_meta.update({"attention.key_length": d, "attention.value_length": d})
    want_meta = {(k if k.startswith(("general.", "tokenizer.")) else f"{arch}.{k}"): v for k, v in want_meta.items()}
    for k, v in want_meta.items():
        if meta.get(k) != v:
            fail(f"{gguf}: {k} is {meta.get(k)!r}, want {v!r}")
    tokens = meta["tokenizer.ggml.tokens"]
    if len(tokens) != cfg["vocab_size"] or len(set(tokens)) != len(tokens):
        fail(f"{gguf}: {len(tokens)} tokens ({len(set(tokens))} distinct) for a vocabulary of {cfg['vocab_size']}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    hf_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    hf_layer.update({"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"})
    for l in range(cfg["num_hidden_layers"]):
        for a, b in hf_layer.items():
            for kind in ("weight", "bias"):
                names[f"model.layers.{l}.{a}.{kind}"] = f"blk.{l}.{b}.{kind}"
    tied = cfg.get("tie_word_embeddings", False)
    expected = {g for k, g in names.items() if k in st}
    if tied and "output.weight" in tensors:
        fail(f"{gguf}: output.weight is written for tied embeddings")
    if set(tensors) != expected:
        fail(f"{gguf}: tensors {sorted(set(tensors) ^ expected)} differ from the export's source")
    for k, g in names.items():
        if k not in st:
            continue
        w = st[k]
        if "q_proj" in k and arch == "llama":
            w = to_llama_rope_rows(w, n_h)
        if "k_proj" in k and arch == "llama":
            w = to_llama_rope_rows(w, n_kv)
        kind, a = tensors[g]
        want = dtype if w.ndim == 2 else "f32"
        if kind != want:
            fail(f"{gguf}: {g} is {kind}, want {want}")
        if a.shape != w.shape or not np.array_equal(a, rounded(w, want)):
            fail(f"{gguf}: {g} ({a.shape}) differs from {k} ({w.shape}) rounded to {want}")
    print(f"{gguf}: {len(tensors)} tensors ({dtype}) and the {arch} hyper-parameters match {hf_dir}")


def compare(tokenizer, foldpar_jsonl, foldpar_stderr, llama_out, prompts):
    ours = {}
    for line in open(foldpar_jsonl):
        j = json.loads(line)
        ours[j["index"]] = j["token_ids"]
    theirs = [json.loads(l[len("RESULT "):]) for l in open(llama_out) if l.startswith("RESULT ")]
    if len(theirs) != len(prompts) or len(ours) != len(prompts):
        fail(f"{len(ours)} foldpar and {len(theirs)} llama.cpp completions for {len(prompts)} prompts")
    m = re.search(r"prefill (\d+) tokens", open(foldpar_stderr).read())
    prefilled = sum(len(t["prompt_ids"]) for t in theirs)
    if not m or int(m.group(1)) != prefilled:
        fail(f"foldpar prefilled {m and m.group(1)} prompt tokens, llama.cpp tokenized the prompts into {prefilled}")
    for i, p in enumerate(prompts):
        if tokenizer == "bytes" and theirs[i]["prompt_ids"] != list(p.encode("utf-8")):
            fail(f"llama.cpp tokenized {p!r} as {theirs[i]['prompt_ids']}, not its bytes")
        a, b = ours[i], theirs[i]["ids"]
        if a != b:
            k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
            fail(f"prompt {p!r}: foldpar and llama.cpp differ at generated token {k}: {a[k:k+4]} vs {b[k:k+4]} "
                 f"(foldpar {a}, llama.cpp {b})")
    print(f"{llama_out}: llama.cpp's greedy tokens equal foldpar's for {len(prompts)} prompts ({len(ours[0])} each)")


def write_safetensors(path, tensors):
    header, offset = {}, 0
    for k, a in tensors.items():
        header[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())


def random_model(config, hf_dir, seed):
    import os
    cfg = json.load(open(config))
    os.makedirs(hf_dir, exist_ok=True)
    json.dump(cfg, open(f"{hf_dir}/config.json", "w"))
    rng = np.random.default_rng(seed)
    h, f, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    t_ = cfg.get("model_type", "llama")
    qkv_bias = t_ == "qwen2"
    w = lambda *shape, std=0.02: (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
    gain = lambda: 1 + w(h, std=0.1)
    t = {"model.embed_tokens.weight": w(V, h)}
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        t.update({p + "input_layernorm.weight": gain(), p + "self_attn.q_proj.weight": w(q, h, std=0.12),
                  p + "self_attn.k_proj.weight": w(kv, h, std=0.12), p + "self_attn.v_proj.weight": w(kv, h),
                  p + "self_attn.o_proj.weight": w(h, q), p + "post_attention_layernorm.weight": gain(),
                  p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h), p + "mlp.down_proj.weight": w(h, f)})
        if qkv_bias:
            t.update({p + "self_attn.q_proj.bias": w(q, std=0.5), p + "self_attn.k_proj.bias": w(kv, std=0.5),
                      p + "self_attn.v_proj.bias": w(kv)})
        if t_ == "qwen3":
            t.update({p + "self_attn.q_norm.weight": 3 + w(d, std=0.3), p + "self_attn.k_norm.weight": 3 + w(d, std=0.3)})
    t["model.norm.weight"] = gain()
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = w(V, h)
    write_safetensors(f"{hf_dir}/model.safetensors", t)


def sharpen(hf_dir, factor):
    path = f"{hf_dir}/model.safetensors"
    data = bytearray(open(path, "rb").read())
    n = struct.unpack_from("<Q", data, 0)[0]
    for k, v in json.loads(data[8:8 + n]).items():
        if any(n in k for n in ("q_proj", "k_proj", "q_norm", "k_norm")):  # qwen3 normalizes q, k: scale the gains
            a, b = v["data_offsets"]
            w = np.frombuffer(bytes(data[8 + n + a:8 + n + b]), dtype=np.float32) * np.float32(factor)
            data[8 + n + a:8 + n + b] = w.tobytes()
    open(path, "wb").write(data)


if __name__ == "__main__":
    if sys.argv[1] == "tensors":
        check_tensors(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:])
    elif sys.argv[1] == "random":
        random_model(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "sharpen":
        sharpen(sys.argv[2], float(sys.argv[3]))
    else:
        raise SystemExit(__doc__)
