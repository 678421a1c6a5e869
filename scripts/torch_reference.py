#!/usr/bin/python3
"""Independent PyTorch oracle for `foldpar verify --dump DIR`.

Rebuilds a Hugging Face LlamaForCausalLM from the dump, computes the loss, the
gradient of every parameter (and the logits, when dumped) in float64, and
compares them against foldpar's numbers.

This file is deliberately written from the Hugging Face Llama definition only;
it shares no code and no math with foldpar's C++ model.

Usage:
    /usr/bin/python3 scripts/torch_reference.py DUMP_DIR [--tol 1e-4] [--json]
    /usr/bin/python3 scripts/torch_reference.py --self-test

Exit status: 0 every relative error is below --tol, 1 at least one is not,
2 bad input (missing file, malformed safetensors/JSON, shapes that do not fit
the config, unsupported config options).

Relative error of a tensor = max|a - b| / max(max|b|, tiny), with a =
foldpar's value and b = the torch (float64) value. A NaN or Inf anywhere
counts as an infinite error.

Output: one line per compared tensor, then the worst one and PASS/FAIL. With
--json the human-readable lines go to stderr and stdout holds a single JSON
object (see `summary` in compare()).

Dump directory layout (all tensors little-endian safetensors):
    config.json          Hugging Face LlamaConfig fields
    model.safetensors    F32 weights, Hugging Face names
    batch.safetensors    input_ids, target_ids  I64 [B, S]  (targets already
                         shifted, -100 = ignored)
    grads.safetensors    d loss / d parameter, same names as the weights
                         (tied embeddings: only model.embed_tokens.weight)
    result.json          {"loss": float, optional "logits_file": NAME}
    NAME                 optional, tensor "logits" F32 [B, S, V]
"""

import argparse
import json
import math
import os
import shutil
import struct
import sys
import tempfile
import time

import numpy as np
import torch

TINY = 1e-30
IGNORE_INDEX = -100


class BadInput(Exception):
    """Anything wrong with the dump itself (exit status 2)."""


# --------------------------------------------------------------------------
# safetensors reader / writer (numpy only)
# --------------------------------------------------------------------------

_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # converted to float32 after reading
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
}
_NP_TO_ST = {np.dtype("float64"): "F64", np.dtype("float32"): "F32",
             np.dtype("int64"): "I64", np.dtype("int32"): "I32"}


def read_safetensors(path):
    """Returns {name: np.ndarray}. Raises BadInput on any format problem."""
    if not os.path.isfile(path):
        raise BadInput(f"missing file: {path}")
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise BadInput(f"{path}: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise BadInput(f"{path}: header length {n} runs past the end of the file ({len(blob)} bytes)")
    try:
        header = json.loads(blob[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: header is not valid JSON: {e}")
    if not isinstance(header, dict):
        raise BadInput(f"{path}: header is not a JSON object")
    data = memoryview(blob)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = [int(s) for s in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise BadInput(f"{path}: tensor {name!r}: bad header entry {info!r} ({e})")
        if dtype not in _DTYPES:
            raise BadInput(f"{path}: tensor {name!r}: unsupported dtype {dtype}")
        if any(s < 0 for s in shape):
            raise BadInput(f"{path}: tensor {name!r}: negative dimension in {shape}")
        npdt = _DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not (0 <= begin <= end <= len(data)) or end - begin != count * npdt.itemsize:
            raise BadInput(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] do not fit "
                           f"shape {shape} {dtype} (data section is {len(data)} bytes)")
        arr = np.frombuffer(data[begin:end], dtype=npdt).reshape(shape).copy()
        if dtype == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr
    return out


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: np.ndarray} with float32/float64/int32/int64 data."""
    header = {}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NP_TO_ST:
            raise ValueError(f"cannot write dtype {arr.dtype} ({name})")
        raw = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _NP_TO_ST[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)  # align the data section, as the spec suggests
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for c in chunks:
            f.write(c)


def read_json(path):
    if not os.path.isfile(path):
        raise BadInput(f"missing file: {path}")
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: not valid JSON: {e}")


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

class LlamaCfg:
    def __init__(self, d):
        if not isinstance(d, dict):
            raise BadInput("config.json is not a JSON object")

        def need(key, kind):
            if key not in d:
                raise BadInput(f"config.json: missing {key}")
            v = d[key]
            if kind is int:
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise BadInput(f"config.json: {key} must be a positive integer, got {v!r}")
            elif kind is float:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                    raise BadInput(f"config.json: {key} must be a positive number, got {v!r}")
                v = float(v)
            elif kind is bool:
                if not isinstance(v, bool):
                    raise BadInput(f"config.json: {key} must be true/false, got {v!r}")
            return v

        self.hidden = need("hidden_size", int)
        self.inter = need("intermediate_size", int)
        self.n_heads = need("num_attention_heads", int)
        self.n_kv = d.get("num_key_value_heads", self.n_heads)  # HF default: = n_heads
        if "num_key_value_heads" in d:
            self.n_kv = need("num_key_value_heads", int)
        self.n_layers = need("num_hidden_layers", int)
        self.vocab = need("vocab_size", int)
        self.eps = need("rms_norm_eps", float)
        self.theta = need("rope_theta", float) if "rope_theta" in d else 10000.0
        self.max_pos = need("max_position_embeddings", int) if "max_position_embeddings" in d else None
        self.tied = need("tie_word_embeddings", bool) if "tie_word_embeddings" in d else False

        # head_dim: d = h / n_h per the HF definition; newer HF configs may carry an
        # explicit head_dim, which HF honours, so we do too.
        if d.get("head_dim") is not None:
            self.head_dim = need("head_dim", int)
        else:
            if self.hidden % self.n_heads:
                raise BadInput(f"config.json: hidden_size {self.hidden} not divisible by "
                               f"num_attention_heads {self.n_heads}")
            self.head_dim = self.hidden // self.n_heads
        if self.head_dim % 2:
            raise BadInput(f"config.json: head dim {self.head_dim} is odd (RoPE needs even)")
        if self.n_heads % self.n_kv:
            raise BadInput(f"config.json: num_attention_heads {self.n_heads} not divisible by "
                           f"num_key_value_heads {self.n_kv}")

        # Refuse options that change the math rather than silently ignoring them.
        self.rope = hf_rope_scaling(d)
        # The attention variants as the transformers modeling files define them: Qwen2 always
        # has q/k/v biases (no o_proj bias); Llama's and Qwen3's attention_bias puts a bias on
        # q, k, v and o; Qwen3 always has the per-head q/k RMSNorm before RoPE.
        mtype = d.get("model_type", "llama")
        bias = bool(d.get("attention_bias", False))
        self.qkv_bias = mtype == "qwen2" or (bias and mtype in ("llama", "qwen3"))
        self.o_bias = bias and mtype in ("llama", "qwen3")
        self.qk_norm = mtype == "qwen3"
        if bias and mtype not in ("llama", "qwen3", "qwen2"):
            raise BadInput(f"config.json: attention_bias=true with model_type {mtype!r} is not supported")
        # LlamaMLP's mlp_bias: gate_proj, up_proj and down_proj with biases (llama only).
        self.mlp_bias = bool(d.get("mlp_bias", False))
        if self.mlp_bias and mtype != "llama":
            raise BadInput(f"config.json: mlp_bias=true with model_type {mtype!r} is not supported")
        self.window = hf_sliding_window(d, mtype, self.n_layers)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise BadInput(f"config.json: hidden_act {act!r} is not supported (only silu)")
        self.moe = MoeCfg.from_config(d)  # None for a dense model

    def param_shapes(self):
        h, f, V, d = self.hidden, self.inter, self.vocab, self.head_dim
        shapes = {"model.embed_tokens.weight": (V, h)}
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (self.n_heads * d, h)
            shapes[p + "self_attn.k_proj.weight"] = (self.n_kv * d, h)
            shapes[p + "self_attn.v_proj.weight"] = (self.n_kv * d, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.n_heads * d)
            if self.qkv_bias:
                shapes[p + "self_attn.q_proj.bias"] = (self.n_heads * d,)
                shapes[p + "self_attn.k_proj.bias"] = (self.n_kv * d,)
                shapes[p + "self_attn.v_proj.bias"] = (self.n_kv * d,)
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (d,)
                shapes[p + "self_attn.k_norm.weight"] = (d,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if self.moe is not None and self.moe.is_sparse(i):
                shapes.update(self.moe.param_shapes(p, h))
                continue
            shapes[p + "mlp.gate_proj.weight"] = (f, h)
            shapes[p + "mlp.up_proj.weight"] = (f, h)
            shapes[p + "mlp.down_proj.weight"] = (h, f)
            if self.mlp_bias:
                shapes[p + "mlp.gate_proj.bias"] = (f,)
                shapes[p + "mlp.up_proj.bias"] = (f,)
                shapes[p + "mlp.down_proj.bias"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tied:
            shapes["lm_head.weight"] = (V, h)
        return shapes


# --------------------------------------------------------------------------
# The model (Hugging Face LlamaForCausalLM and the variants above), plain torch ops
# --------------------------------------------------------------------------

def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# --------------------------------------------------------------------------
# RoPE scaling, from Hugging Face transformers' modeling_rope_utils (the
# _compute_*_parameters functions and dynamic_rope_update), in float64
# --------------------------------------------------------------------------

_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def hf_rope_scaling(d):
    """config.json's rope_scaling as a dict with "rope_type" (None: unscaled)."""
    rs = d.get("rope_scaling")
    if rs in (None, {}):
        return None
    if not isinstance(rs, dict):
        raise BadInput(f"config.json: rope_scaling {rs!r} is not an object")
    kind = rs.get("rope_type", rs.get("type"))
    if kind not in _ROPE_TYPES:
        raise BadInput(f"config.json: rope_scaling type {kind!r} is not supported by the oracle")
    return None if kind == "default" else dict(rs, rope_type=kind)


def hf_rope_inv_freq(cfg, seq_len, dtype):
    """(inv_freq [d/2], attention_factor) for a forward over seq_len positions."""
    base, dim, rs = cfg.theta, cfg.head_dim, cfg.rope
    kind = rs["rope_type"] if rs else "default"

    def default(b):
        return 1.0 / (b ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))

    if kind == "default":
        return default(base), 1.0
    factor = float(rs["factor"])
    if kind == "linear":
        return default(base) / factor, 1.0
    if kind == "dynamic":
        # dynamic_rope_update: the NTK base grows once the sequence outruns max_position_embeddings.
        max_pos = cfg.max_pos
        L = max(seq_len, max_pos)
        b = base * ((factor * L / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return default(b), 1.0
    if kind == "llama3":
        inv_freq = default(base)
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn, with the user's factor in effect (transformers after PR 40320, as vLLM and TGI).
    original = rs.get("original_max_position_embeddings") or cfg.max_pos

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if rs.get("mscale") and rs.get("mscale_all_dim"):
            attention_factor = get_mscale(factor, rs["mscale"]) / get_mscale(factor, rs["mscale_all_dim"])
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rot):
        return (dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=dtype) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=dtype) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(seq, head_dim, theta, dtype, cfg=None):
    if cfg is None:
        inv_freq, scale = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim)), 1.0
    else:
        inv_freq, scale = hf_rope_inv_freq(cfg, seq, dtype)
    pos = torch.arange(seq, dtype=dtype)
    freqs = pos[:, None] * inv_freq[None, :]          # [S, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)             # [S, d]
    return emb.cos() * scale, emb.sin() * scale


def hf_sliding_window(d, mtype, layers):
    """The window every layer uses, as transformers applies it (0: none). MistralConfig defaults
    sliding_window to 4096, MixtralConfig to None; Qwen2/Qwen3 window only with
    use_sliding_window, and only layers >= max_window_layers (default 28); Llama ignores it."""
    w = d.get("sliding_window", 4096 if mtype == "mistral" else None)
    if mtype in ("mistral", "mixtral"):
        return int(w) if w is not None else 0
    if mtype in ("qwen2", "qwen3") and d.get("use_sliding_window", False) and w is not None:
        types = d.get("layer_types")
        if types is not None:
            if any(t != "full_attention" for t in types):
                raise BadInput("config.json: per-layer sliding windows (layer_types) are not supported by the oracle")
            return 0
        if d.get("max_window_layers", 28) < layers:
            raise BadInput("config.json: per-layer sliding windows (max_window_layers) are not supported by the oracle")
    return 0


def attention(x, p, cfg, cos, sin):
    B, S, _ = x.shape
    d, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv
    def proj(name):
        y = x @ p[f"self_attn.{name}.weight"].t()
        return y + p[f"self_attn.{name}.bias"] if cfg.qkv_bias else y
    q, k, v = proj("q_proj").view(B, S, nh, d), proj("k_proj").view(B, S, nkv, d), proj("v_proj").view(B, S, nkv, d)
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's d, gains shared by the heads
        q = rms_norm(q, p["self_attn.q_norm.weight"], cfg.eps)
        k = rms_norm(k, p["self_attn.k_norm.weight"], cfg.eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # [B, n, S, d]
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    g = nh // nkv
    # kv head j serves query heads j*g .. j*g+g-1 (HF repeat_kv)
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)                              # [B, nh, S, S]
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    if cfg.window:  # transformers masking_utils: key j visible to query i iff i - W < j <= i
        causal = causal | torch.ones(S, S, dtype=torch.bool).tril(-cfg.window)
    scores = scores.masked_fill(causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(B, S, nh * d)
    out = out @ p["self_attn.o_proj.weight"].t()
    return out + p["self_attn.o_proj.bias"] if cfg.o_bias else out


def mlp(x, p, cfg):
    def proj(name, y):
        y = y @ p[f"mlp.{name}.weight"].t()
        return y + p[f"mlp.{name}.bias"] if cfg.mlp_bias else y
    gate = torch.nn.functional.silu(proj("gate_proj", x))
    return proj("down_proj", gate * proj("up_proj", x))


# --------------------------------------------------------------------------
# Mixture of experts: Hugging Face's MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock /
# Qwen3MoeSparseMoeBlock and load_balancing_loss_func, written from their definitions.
# Kept apart from the attention side. Ties in the top-k go to the lower expert index
# (a stable descending sort), the rule foldpar documents; torch.topk leaves ties unspecified.
# --------------------------------------------------------------------------

class MoeCfg:
    FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")

    @staticmethod
    def from_config(d):
        t = d.get("model_type")
        if t not in MoeCfg.FAMILIES:
            for key in ("num_local_experts", "num_experts"):
                if d.get(key):
                    raise BadInput(f"config.json: {key} given for model_type {t!r}, which has no experts")
            return None
        return MoeCfg(d, t)

    def __init__(self, d, family):
        def pos_int(key, default=None):
            v = d.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise BadInput(f"config.json: {key} must be a positive integer, got {v!r}")
            return v
        self.family = family
        if family == "mixtral":
            self.n_experts = pos_int("num_local_experts")
            self.inter = pos_int("intermediate_size")
            self.norm_topk = True
            self.shared = 0
            self.sparse_step, self.mlp_only = 1, []
        else:
            self.n_experts = pos_int("num_experts")
            self.inter = pos_int("moe_intermediate_size")
            self.norm_topk = bool(d.get("norm_topk_prob", False))
            self.shared = d.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
            self.sparse_step = pos_int("decoder_sparse_step", 1)
            self.mlp_only = list(d.get("mlp_only_layers", []) or [])
        self.top_k = pos_int("num_experts_per_tok")
        if self.top_k > self.n_experts:
            raise BadInput(f"config.json: num_experts_per_tok {self.top_k} > experts {self.n_experts}")
        self.aux_coef = float(d.get("router_aux_loss_coef", 0.0))
        self.output_router_logits = bool(d.get("output_router_logits", False))
        # foldpar's capacity limit (0: dropless): expert e keeps at most ceil(C S k / E) of each
        # sequence's token-expert pairs, in position order (a token's k choices in rank order).
        self.capacity_factor = float(d.get("moe_capacity_factor", 0.0) or 0.0)

    def is_sparse(self, i):
        return i not in self.mlp_only and (i + 1) % self.sparse_step == 0

    def names(self, e):
        """(router, gate, up, down) names of expert e inside a layer."""
        if self.family == "mixtral":
            q = f"block_sparse_moe.experts.{e}."
            return "block_sparse_moe.gate.weight", q + "w1.weight", q + "w3.weight", q + "w2.weight"
        q = f"mlp.experts.{e}."
        return "mlp.gate.weight", q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight"

    def param_shapes(self, p, h):
        f = self.inter
        shapes = {p + self.names(0)[0]: (self.n_experts, h)}
        for e in range(self.n_experts):
            _, g, u, dn = self.names(e)
            shapes[p + g], shapes[p + u], shapes[p + dn] = (f, h), (f, h), (h, f)
        if self.shared:
            fs = self.shared
            for n, shape in (("gate_proj", (fs, h)), ("up_proj", (fs, h)), ("down_proj", (h, fs))):
                shapes[p + f"mlp.shared_expert.{n}.weight"] = shape
            shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
        return shapes


def _top_k(probs, k):
    order = torch.sort(probs, dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


def _gated(x, g, u, dn):
    return (torch.nn.functional.silu(x @ g.t()) * (x @ u.t())) @ dn.t()


def moe_block(x, p, m):
    """x [B, S, h] -> (y [B, S, h], router logits [B*S, E]), as the HF sparse MoE block."""
    B, S, h = x.shape
    xs = x.reshape(-1, h)
    router = p[m.names(0)[0]]
    logits = xs @ router.t()
    routing = torch.softmax(logits, dim=-1)
    weights, selected = _top_k(routing, m.top_k)
    if m.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if m.capacity_factor > 0:
        # Written as a running count per sequence over the (token, slot) pairs, independently of
        # foldpar's loop: a pair is kept while its expert's count so far is within capacity.
        cap = math.ceil(m.capacity_factor * S * m.top_k / m.n_experts)
        onehot = torch.nn.functional.one_hot(selected.reshape(B, S * m.top_k), m.n_experts)  # [B, S k, E]
        rank = (torch.cumsum(onehot, dim=1) * onehot).sum(dim=-1)                       # 1-based, per expert
        keep = (rank <= cap).reshape(B * S, m.top_k)
        weights = weights * keep.to(weights.dtype)  # a dropped pair adds nothing, gets no gradient
    out = torch.zeros_like(xs)
    for e in range(m.n_experts):
        tok, slot = torch.where(selected == e)
        if tok.numel() == 0:
            continue
        _, g, u, dn = m.names(e)
        y = _gated(xs[tok], p[g], p[u], p[dn]) * weights[tok, slot, None]
        out = out.index_add(0, tok, y)
    if m.shared:
        z = _gated(xs, p["mlp.shared_expert.gate_proj.weight"], p["mlp.shared_expert.up_proj.weight"],
                   p["mlp.shared_expert.down_proj.weight"])
        out = out + torch.sigmoid(xs @ p["mlp.shared_expert_gate.weight"].t()) * z
    return out.view(B, S, h), logits


def load_balancing_loss(gate_logits, n_experts, top_k):
    """HF load_balancing_loss_func without an attention mask: every layer's logits concatenated."""
    cat = torch.cat(gate_logits, dim=0)                                    # [L*T, E]
    routing = torch.softmax(cat, dim=-1)
    _, selected = _top_k(routing, top_k)
    mask = torch.nn.functional.one_hot(selected, n_experts).to(cat.dtype)  # [L*T, k, E]
    tokens_per_expert = mask.mean(dim=0)                                   # [k, E]
    router_prob_per_expert = routing.mean(dim=0)                           # [E]
    return (tokens_per_expert * router_prob_per_expert.unsqueeze(0)).sum() * n_experts


def forward(cfg, params, input_ids, target_ids):
    """Returns (loss, logits). params: {hf_name: tensor}."""
    S = input_ids.shape[1]
    embed = params["model.embed_tokens.weight"]
    dtype = embed.dtype
    cos, sin = rope_cos_sin(S, cfg.head_dim, cfg.theta, dtype, cfg)
    x = embed[input_ids]
    router_logits = []  # MoE: each sparse layer's [B*S, E]
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        p = {k[len(pre):]: v for k, v in params.items() if k.startswith(pre)}
        x = x + attention(rms_norm(x, p["input_layernorm.weight"], cfg.eps), p, cfg, cos, sin)
        a = rms_norm(x, p["post_attention_layernorm.weight"], cfg.eps)
        if cfg.moe is not None and cfg.moe.is_sparse(i):
            y, logits_i = moe_block(a, p, cfg.moe)
            router_logits.append(logits_i)
            x = x + y
        else:
            x = x + mlp(a, p, cfg)
    x = rms_norm(x, params["model.norm.weight"], cfg.eps)
    head = embed if cfg.tied else params["lm_head.weight"]
    logits = x @ head.t()                                                           # [B, S, V]
    logp = torch.log_softmax(logits, dim=-1)
    valid = target_ids != IGNORE_INDEX
    safe_t = torch.where(valid, target_ids, torch.zeros_like(target_ids))
    nll = -logp.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1)
    loss = (nll * valid.to(dtype)).sum() / valid.sum().to(dtype)
    if cfg.moe is not None and cfg.moe.output_router_logits and router_logits:
        loss = loss + cfg.moe.aux_coef * load_balancing_loss(router_logits, cfg.moe.n_experts, cfg.moe.top_k)
    return loss, logits


def loss_and_grads(cfg, weights, input_ids, target_ids, dtype):
    """weights: {name: np.ndarray}. Returns (loss float, {name: grad ndarray}, logits ndarray)."""
    params = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in weights.items()}
    ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))
    tgt = torch.from_numpy(np.asarray(target_ids, dtype=np.int64))
    loss, logits = forward(cfg, params, ids, tgt)
    loss.backward()
    grads = {k: p.grad.detach().numpy() for k, p in params.items()}
    return float(loss.item()), grads, logits.detach().numpy()


# --------------------------------------------------------------------------
# Loading and comparing a dump
# --------------------------------------------------------------------------

def load_dump(dump_dir):
    if not os.path.isdir(dump_dir):
        raise BadInput(f"not a directory: {dump_dir}")
    cfg = LlamaCfg(read_json(os.path.join(dump_dir, "config.json")))
    shapes = cfg.param_shapes()

    weights = read_safetensors(os.path.join(dump_dir, "model.safetensors"))
    if cfg.tied and "lm_head.weight" in weights:
        # Some writers store the tied head anyway; accept it only if it is the embedding.
        if not np.array_equal(weights["lm_head.weight"], weights.get("model.embed_tokens.weight")):
            raise BadInput("model.safetensors: tie_word_embeddings is true but lm_head.weight "
                           "differs from model.embed_tokens.weight")
        del weights["lm_head.weight"]
    for k in [k for k in weights if k.endswith("rotary_emb.inv_freq")]:
        del weights[k]  # a buffer some HF versions save; recomputed here
    _check_names("model.safetensors", weights, shapes)
    for k, v in weights.items():
        if not np.issubdtype(v.dtype, np.floating):
            raise BadInput(f"model.safetensors: {k} has non-float dtype {v.dtype}")

    batch = read_safetensors(os.path.join(dump_dir, "batch.safetensors"))
    for k in ("input_ids", "target_ids"):
        if k not in batch:
            raise BadInput(f"batch.safetensors: missing {k}")
        if not np.issubdtype(batch[k].dtype, np.integer):
            raise BadInput(f"batch.safetensors: {k} must be integer, got {batch[k].dtype}")
        if batch[k].ndim != 2:
            raise BadInput(f"batch.safetensors: {k} must be [B, S], got shape {list(batch[k].shape)}")
    ids, tgt = batch["input_ids"].astype(np.int64), batch["target_ids"].astype(np.int64)
    if ids.shape != tgt.shape or ids.size == 0:
        raise BadInput(f"batch.safetensors: input_ids {list(ids.shape)} and target_ids "
                       f"{list(tgt.shape)} must have the same non-empty shape")
    if ids.min() < 0 or ids.max() >= cfg.vocab:
        raise BadInput(f"batch.safetensors: input_ids outside [0, {cfg.vocab})")
    valid = tgt != IGNORE_INDEX
    if not valid.any():
        raise BadInput("batch.safetensors: every target is -100; the loss is undefined")
    if tgt[valid].min() < 0 or tgt[valid].max() >= cfg.vocab:
        raise BadInput(f"batch.safetensors: target_ids outside [0, {cfg.vocab}) and not -100")

    grads = read_safetensors(os.path.join(dump_dir, "grads.safetensors"))
    _check_names("grads.safetensors", grads, shapes)

    result = read_json(os.path.join(dump_dir, "result.json"))
    if not isinstance(result, dict) or "loss" not in result:
        raise BadInput("result.json: missing \"loss\"")
    loss = result["loss"]
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        raise BadInput(f"result.json: loss must be a number, got {loss!r}")
    logits = None
    lf = result.get("logits_file")
    if lf is not None:
        if not isinstance(lf, str):
            raise BadInput(f"result.json: logits_file must be a string, got {lf!r}")
        lt = read_safetensors(os.path.join(dump_dir, lf))
        if "logits" not in lt:
            raise BadInput(f"{lf}: missing tensor \"logits\"")
        logits = lt["logits"]
        want = (ids.shape[0], ids.shape[1], cfg.vocab)
        if tuple(logits.shape) != want:
            raise BadInput(f"{lf}: logits shape {list(logits.shape)}, expected {list(want)}")
    if cfg.max_pos is not None and ids.shape[1] > cfg.max_pos:
        print(f"warning: sequence length {ids.shape[1]} exceeds max_position_embeddings "
              f"{cfg.max_pos}", file=sys.stderr)
    return cfg, weights, ids, tgt, grads, float(loss), logits


def _check_names(fname, tensors, shapes):
    missing = [k for k in shapes if k not in tensors]
    extra = [k for k in tensors if k not in shapes]
    if missing:
        raise BadInput(f"{fname}: missing tensors: {', '.join(missing)}")
    if extra:
        raise BadInput(f"{fname}: unexpected tensors: {', '.join(extra)}")
    for k, shape in shapes.items():
        if tuple(tensors[k].shape) != tuple(shape):
            raise BadInput(f"{fname}: {k} has shape {list(tensors[k].shape)}, expected {list(shape)}")


def rel_err(a, b):
    """max|a-b| / max(max|b|, tiny); NaN/Inf anywhere -> inf."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return math.inf, math.inf, math.nan
    diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    ref = float(np.max(np.abs(b))) if b.size else 0.0
    return diff / max(ref, TINY), diff, ref


def compare(dump_dir, tol, out=sys.stdout):
    """Returns (exit_code, summary dict). Raises BadInput."""
    cfg, weights, ids, tgt, fp_grads, fp_loss, fp_logits = load_dump(dump_dir)
    t0 = time.perf_counter()
    loss, grads, logits = loss_and_grads(cfg, weights, ids, tgt, torch.float64)
    elapsed = time.perf_counter() - t0

    rows = [("loss",) + rel_err(fp_loss, loss)]
    if fp_logits is not None:
        rows.append(("logits",) + rel_err(fp_logits, logits))
    for name in cfg.param_shapes():
        rows.append(("grad " + name,) + rel_err(fp_grads[name], grads[name]))

    width = max(len(r[0]) for r in rows)
    print(f"foldpar dump {dump_dir}: B={ids.shape[0]} S={ids.shape[1]} layers={cfg.n_layers} "
          f"h={cfg.hidden} heads={cfg.n_heads}/{cfg.n_kv} V={cfg.vocab} tied={cfg.tied} "
          f"valid_targets={int((tgt != IGNORE_INDEX).sum())}", file=out)
    print(f"loss: foldpar {fp_loss:.9g}  torch(f64) {loss:.9g}   (oracle took {elapsed:.2f} s)", file=out)
    print(f"{'tensor':<{width}}  {'rel_err':>10}  {'max_abs_diff':>12}  {'max_abs_ref':>12}", file=out)
    for name, r, diff, ref in rows:
        flag = "" if r < tol else "  <-- FAIL"
        print(f"{name:<{width}}  {r:10.3e}  {diff:12.3e}  {ref:12.3e}{flag}", file=out)
    worst = max(rows, key=lambda r: (r[1] if not math.isnan(r[1]) else math.inf))
    ok = all(r[1] < tol for r in rows)
    print(f"worst: {worst[0]}  rel_err {worst[1]:.3e}  (tol {tol:g})", file=out)
    print("PASS" if ok else "FAIL", file=out)
    summary = {
        "pass": ok, "tol": tol, "dump": dump_dir,
        "loss": {"foldpar": fp_loss, "torch": loss},
        "worst": {"name": worst[0], "rel_err": _jnum(worst[1])},
        "tensors": [{"name": n, "rel_err": _jnum(r), "max_abs_diff": _jnum(d), "max_abs_ref": _jnum(ref)}
                    for n, r, d, ref in rows],
    }
    return (0 if ok else 1), summary


def _jnum(x):
    # JSON has no inf/nan; encode them as strings so the output stays strict JSON.
    return x if math.isfinite(x) else str(x)


# --------------------------------------------------------------------------
# Self-test
# --------------------------------------------------------------------------

def _random_weights(cfg, rng):
    w = {}
    for name, shape in cfg.param_shapes().items():
        if name.endswith("norm.weight"):
            w[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w[name] = (0.08 * rng.standard_normal(shape)).astype(np.float32)
    return w


def _write_dump(dump_dir, cfg_dict, weights, ids, tgt, with_logits):
    """Writes a dump in foldpar's format using this script's own float32 numbers."""
    cfg = LlamaCfg(cfg_dict)
    loss, grads, logits = loss_and_grads(cfg, weights, ids, tgt, torch.float32)
    os.makedirs(dump_dir, exist_ok=True)
    with open(os.path.join(dump_dir, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)
    write_safetensors(os.path.join(dump_dir, "model.safetensors"), weights, {"format": "pt"})
    write_safetensors(os.path.join(dump_dir, "batch.safetensors"), {"input_ids": ids, "target_ids": tgt})
    write_safetensors(os.path.join(dump_dir, "grads.safetensors"),
                      {k: v.astype(np.float32) for k, v in grads.items()})
    result = {"loss": loss}
    if with_logits:
        result["logits_file"] = "logits.safetensors"
        write_safetensors(os.path.join(dump_dir, "logits.safetensors"), {"logits": logits.astype(np.float32)})
    with open(os.path.join(dump_dir, "result.json"), "w") as f:
        json.dump(result, f)


def _loop_attention_check(cfg, weights, ids):
    """Second, loop-based implementation of one attention block (per head, per query
    position, explicit GQA index and explicit RoPE pairs) to cross-check the vectorized
    one, so the self-test proves more than write/read symmetry."""
    w = {k: torch.tensor(v, dtype=torch.float64) for k, v in weights.items()}
    x = w["model.embed_tokens.weight"][torch.from_numpy(ids)][0]  # batch row 0: [S, h]
    S, d = x.shape[0], cfg.head_dim
    p = "model.layers.0."
    a = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.eps) * w[p + "input_layernorm.weight"]
    q_all = a @ w[p + "self_attn.q_proj.weight"].t()
    k_all = a @ w[p + "self_attn.k_proj.weight"].t()
    v_all = a @ w[p + "self_attn.v_proj.weight"].t()

    def rope(vec, pos):
        outv = vec.clone()
        half = d // 2
        for i in range(half):
            ang = pos / (cfg.theta ** (2 * i / d))
            c, s = math.cos(ang), math.sin(ang)
            outv[i] = vec[i] * c - vec[i + half] * s
            outv[i + half] = vec[i + half] * c + vec[i] * s
        return outv

    g = cfg.n_heads // cfg.n_kv
    heads = []
    for hq in range(cfg.n_heads):
        j = hq // g
        ks = [rope(k_all[t, j * d:(j + 1) * d], t) for t in range(S)]
        vs = [v_all[t, j * d:(j + 1) * d] for t in range(S)]
        rows = []
        for t in range(S):
            qv = rope(q_all[t, hq * d:(hq + 1) * d], t)
            sc = torch.stack([qv.dot(ks[u]) / math.sqrt(d) for u in range(t + 1)])
            pr = torch.exp(sc - sc.max())
            pr = pr / pr.sum()
            rows.append(sum(pr[u] * vs[u] for u in range(t + 1)))
        heads.append(torch.stack(rows))
    loop_out = torch.cat(heads, dim=-1) @ w[p + "self_attn.o_proj.weight"].t()
    lp = {k[len(p):]: v for k, v in w.items() if k.startswith(p)}
    cos, sin = rope_cos_sin(S, d, cfg.theta, torch.float64)
    vec_out = attention(a[None], lp, cfg, cos, sin)[0]
    return float((loop_out - vec_out).abs().max() / vec_out.abs().max())


def self_test(tol):
    t_start = time.perf_counter()
    rng = np.random.default_rng(1234)
    failures = []

    def check(what, cond):
        print(f"  [{'ok' if cond else 'FAILED'}] {what}")
        if not cond:
            failures.append(what)

    base_cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 8,
        "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
        "hidden_act": "silu", "unrelated_key": [1, 2, 3],
    }
    B, S = 2, 16
    tmp = tempfile.mkdtemp(prefix="torch_reference_selftest_")
    devnull = open(os.devnull, "w")
    try:
        # Round-trip of the safetensors writer/reader, including the I64 batch format.
        rt = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.int64) - 100,
              "c": rng.standard_normal((2,)).astype(np.float64)}
        write_safetensors(os.path.join(tmp, "rt.safetensors"), rt, {"k": "v"})
        back = read_safetensors(os.path.join(tmp, "rt.safetensors"))
        check("safetensors round trip", set(back) == set(rt) and
              all(back[k].dtype == rt[k].dtype and np.array_equal(back[k], rt[k]) for k in rt))

        for tied in (False, True):
            cfg_dict = dict(base_cfg, tie_word_embeddings=tied)
            cfg = LlamaCfg(cfg_dict)
            weights = _random_weights(cfg, rng)
            ids = rng.integers(0, cfg.vocab, size=(B, S), dtype=np.int64)
            tgt = np.concatenate([ids[:, 1:], rng.integers(0, cfg.vocab, size=(B, 1))], axis=1).astype(np.int64)
            tgt[0, 3] = tgt[0, 9] = tgt[1, 0] = tgt[1, S - 1] = IGNORE_INDEX
            tag = "tied" if tied else "untied"
            dump = os.path.join(tmp, tag)
            _write_dump(dump, cfg_dict, weights, ids, tgt, with_logits=not tied)

            code, summary = compare(dump, tol, out=sys.stdout)
            check(f"{tag}: own f32 dump matches the f64 oracle (worst {summary['worst']['rel_err']:.2e} "
                  f"at {summary['worst']['name']})", code == 0)
            n_grads = sum(1 for t in summary["tensors"] if t["name"].startswith("grad "))
            check(f"{tag}: compared {n_grads} gradients (expected {len(cfg.param_shapes())})"
                  + (", no lm_head" if tied else ""), n_grads == len(cfg.param_shapes()))

            # A perturbed gradient must fail the comparison.
            gpath = os.path.join(dump, "grads.safetensors")
            good = read_safetensors(gpath)
            name = "model.layers.1.self_attn.k_proj.weight"
            bad = dict(good)
            bad[name] = good[name].copy()
            bad[name][5, 7] += 1e-2 * np.abs(good[name]).max()
            write_safetensors(gpath, bad)
            code, summary = compare(dump, tol, out=devnull)
            check(f"{tag}: perturbed {name} is caught (exit {code}, worst {summary['worst']['name']})",
                  code == 1 and summary["worst"]["name"] == "grad " + name)
            write_safetensors(gpath, good)

            # A loss off by 1e-3 relative must be rejected too.
            res_path = os.path.join(dump, "result.json")
            with open(res_path) as f:
                res = json.load(f)
            with open(res_path, "w") as f:
                json.dump(dict(res, loss=res["loss"] * (1 + 1e-3)), f)
            code, _ = compare(dump, tol, out=devnull)
            check(f"{tag}: loss off by 1e-3 relative is caught (exit {code})", code == 1)
            with open(res_path, "w") as f:
                json.dump(res, f)

            # Bad input: missing file, truncated file, wrong shape -> exit 2.
            bad_dir = os.path.join(tmp, tag + "_bad")
            shutil.copytree(dump, bad_dir)
            os.remove(os.path.join(bad_dir, "grads.safetensors"))
            check(f"{tag}: missing grads.safetensors -> exit 2", main([bad_dir], out=devnull) == 2)
            shutil.copy(gpath, os.path.join(bad_dir, "grads.safetensors"))
            with open(os.path.join(bad_dir, "model.safetensors"), "r+b") as f:
                f.truncate(os.path.getsize(os.path.join(bad_dir, "model.safetensors")) - 4)
            check(f"{tag}: truncated model.safetensors -> exit 2", main([bad_dir], out=devnull) == 2)
            shutil.rmtree(bad_dir)

        # Independent cross-check of the attention block against an explicit loop version.
        cfg = LlamaCfg(dict(base_cfg, tie_word_embeddings=False))
        weights = _random_weights(cfg, rng)
        ids = rng.integers(0, cfg.vocab, size=(1, 8), dtype=np.int64)
        r = _loop_attention_check(cfg, weights, ids)
        check(f"vectorized attention (RoPE, GQA, causal) matches the loop version (rel {r:.1e})", r < 1e-12)

        # Causality: changing the last input token leaves earlier logits untouched.
        ids2 = ids.copy()
        ids2[0, -1] = (ids2[0, -1] + 1) % cfg.vocab
        tg = np.zeros_like(ids)
        _, _, l1 = loss_and_grads(cfg, weights, ids, tg, torch.float64)
        _, _, l2 = loss_and_grads(cfg, weights, ids2, tg, torch.float64)
        check("causal: earlier logits independent of the last token",
              np.array_equal(l1[:, :-1], l2[:, :-1]) and not np.array_equal(l1[:, -1], l2[:, -1]))

        # Loss normalization: the mean is over valid targets of the whole batch.
        tg = rng.integers(0, cfg.vocab, size=(2, 8), dtype=np.int64)
        ids = rng.integers(0, cfg.vocab, size=(2, 8), dtype=np.int64)
        tg[0, :6] = IGNORE_INDEX
        loss, _, lg = loss_and_grads(cfg, weights, ids, tg, torch.float64)
        lp = torch.log_softmax(torch.from_numpy(lg), -1).numpy()
        nll = [-lp[b, t, tg[b, t]] for b in range(2) for t in range(8) if tg[b, t] != IGNORE_INDEX]
        check("loss = sum of NLL over valid targets / count of valid targets in the batch",
              abs(loss - sum(nll) / len(nll)) < 1e-12 * abs(loss))
    finally:
        devnull.close()
        shutil.rmtree(tmp, ignore_errors=True)

    elapsed = time.perf_counter() - t_start
    if failures:
        print(f"SELF-TEST FAILED ({len(failures)} checks, {elapsed:.1f} s)")
        return 1
    print(f"SELF-TEST PASSED ({elapsed:.1f} s)")
    return 0


# --------------------------------------------------------------------------

def main(argv=None, out=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump_dir", nargs="*", help="directories written by `foldpar verify --dump` (each checked)")
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative error per tensor (default 1e-4)")
    ap.add_argument("--json", action="store_true",
                    help="print a JSON summary on stdout (the table then goes to stderr)")
    ap.add_argument("--self-test", action="store_true",
                    help="build a random tiny model, write and check its own dump, check failures are caught")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    torch.set_num_threads(max(1, args.threads))
    if args.self_test:
        return self_test(args.tol)
    if not args.dump_dir:
        ap.print_usage(sys.stderr)
        print("error: DUMP_DIR is required (or --self-test)", file=sys.stderr)
        return 2
    if out is None:
        out = sys.stderr if args.json else sys.stdout
    worst = 0
    for dump_dir in args.dump_dir:  # several in one process: torch starts once
        try:
            code, summary = compare(dump_dir, args.tol, out=out)
        except BadInput as e:
            print(f"error: {dump_dir}: {e}", file=sys.stderr)
            if args.json:
                print(json.dumps({"pass": False, "error": str(e)}))
            return 2
        if args.json:
            print(json.dumps(summary, indent=2))
        worst = max(worst, code)
    return worst


if __name__ == "__main__":
    sys.exit(main())
