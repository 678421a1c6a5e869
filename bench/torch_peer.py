#!/usr/bin/python3
"""Benchmark peer: a plain-PyTorch fp32 Llama (Hugging Face LlamaForCausalLM
architecture) timed on forward + backward of the training loss.

Attention is materialized the way plain PyTorch does it:
softmax(Q K^T * scale + causal_mask) V, with the full [B, heads, S, S] score
tensor kept for backward (no fused / flash attention; torch 1.13 has no
scaled_dot_product_attention anyway).

Usage:
    /usr/bin/python3 bench/torch_peer.py --config configs/small.json \
        --seq 1024 --seq 4096 [--batch 1] [--threads 1] [--steps 5] [--warmup 1] [--json]

Each sequence length runs in a fresh subprocess (this script re-invoking itself
with one --seq), so the reported peak RSS (getrusage ru_maxrss of that process)
belongs to that S alone. Per S it reports the median seconds per step
(forward + backward, optimizer excluded, gradients cleared between steps),
tokens/s = B*S / median, and the peak RSS. With --json, stdout holds one JSON
object per S (one per line) and the table goes to stderr.
"""

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

class Cfg:
    def __init__(self, d):
        self.hidden = int(d["hidden_size"])
        self.inter = int(d["intermediate_size"])
        self.n_heads = int(d["num_attention_heads"])
        self.n_kv = int(d.get("num_key_value_heads", self.n_heads))
        self.n_layers = int(d["num_hidden_layers"])
        self.vocab = int(d["vocab_size"])
        self.eps = float(d["rms_norm_eps"])
        self.theta = float(d.get("rope_theta", 10000.0))
        self.max_pos = int(d.get("max_position_embeddings", 0)) or None
        self.tied = bool(d.get("tie_word_embeddings", False))
        self.head_dim = int(d.get("head_dim") or self.hidden // self.n_heads)


def init_params(cfg, seed):
    """normal(0, 0.02) for every matrix, 1 for every norm weight; fixed seed."""
    g = torch.Generator().manual_seed(seed)

    def mat(rows, cols):
        return (torch.randn(rows, cols, generator=g) * 0.02).requires_grad_()

    def ones(n):
        return torch.ones(n).requires_grad_()

    h, f, d = cfg.hidden, cfg.inter, cfg.head_dim
    p = {"embed": mat(cfg.vocab, h), "layers": []}
    for _ in range(cfg.n_layers):
        p["layers"].append({
            "ln_in": ones(h),
            "wq": mat(cfg.n_heads * d, h), "wk": mat(cfg.n_kv * d, h),
            "wv": mat(cfg.n_kv * d, h), "wo": mat(h, cfg.n_heads * d),
            "ln_post": ones(h),
            "wgate": mat(f, h), "wup": mat(f, h), "wdown": mat(h, f),
        })
    p["norm"] = ones(h)
    p["head"] = p["embed"] if cfg.tied else mat(cfg.vocab, h)
    return p


def all_params(p):
    out = [p["embed"], p["norm"]]
    for layer in p["layers"]:
        out.extend(layer.values())
    if p["head"] is not p["embed"]:
        out.append(p["head"])
    return out


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def forward_loss(cfg, p, ids, targets, cos, sin, mask):
    B, S = ids.shape
    nh, nkv, d = cfg.n_heads, cfg.n_kv, cfg.head_dim
    g = nh // nkv
    scale = 1.0 / math.sqrt(d)
    x = p["embed"][ids]
    for L in p["layers"]:
        a = rms_norm(x, L["ln_in"], cfg.eps)
        q = (a @ L["wq"].t()).view(B, S, nh, d).transpose(1, 2)
        k = (a @ L["wk"].t()).view(B, S, nkv, d).transpose(1, 2)
        v = (a @ L["wv"].t()).view(B, S, nkv, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if g > 1:
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
        scores = (q @ k.transpose(-1, -2)) * scale + mask      # [B, nh, S, S]
        probs = torch.softmax(scores, dim=-1)
        o = (probs @ v).transpose(1, 2).reshape(B, S, nh * d)
        x = x + o @ L["wo"].t()
        m = rms_norm(x, L["ln_post"], cfg.eps)
        x = x + (F.silu(m @ L["wgate"].t()) * (m @ L["wup"].t())) @ L["wdown"].t()
    x = rms_norm(x, p["norm"], cfg.eps)
    logits = x @ p["head"].t()
    return F.cross_entropy(logits.view(B * S, cfg.vocab), targets.view(B * S), ignore_index=-100)


# --------------------------------------------------------------------------
# One sequence length, in this process
# --------------------------------------------------------------------------

def run_one(cfg, seq, batch, threads, steps, warmup, seed, bf16=False):
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    p = init_params(cfg, seed)
    params = all_params(p)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab, (batch, seq), generator=g)
    targets = torch.randint(0, cfg.vocab, (batch, seq), generator=g)

    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.full((seq, seq), float("-inf")).triu(1)

    times = []
    loss_val = None
    for i in range(warmup + steps):
        for t in params:
            t.grad = None
        t0 = time.perf_counter()
        # --bf16: the forward under torch.autocast("cpu", bfloat16), PyTorch's own mixed
        # precision (matmuls in bf16, reductions and the loss in f32; f32 master weights).
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = forward_loss(cfg, p, ids, targets, cos, sin, mask)
        loss.backward()
        dt = time.perf_counter() - t0
        loss_val = float(loss.item())
        del loss
        if i >= warmup:
            times.append(dt)
    med = statistics.median(times)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "seq": seq, "batch": batch, "threads": threads,
        "tokens_per_s": batch * seq / med,
        "step_s_median": med,
        "step_s_min": min(times), "step_s_max": max(times), "steps": steps, "warmup": warmup,
        "peak_rss_bytes": peak_kb * 1024,
        "loss": loss_val,
        "dtype": "bf16 autocast" if bf16 else "f32",
        "torch": torch.__version__,
    }


# --------------------------------------------------------------------------

def parse_seqs(values):
    out = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if part:
                n = int(part)
                if n <= 0:
                    raise ValueError(f"sequence length must be positive, got {n}")
                out.append(n)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="Hugging Face style config.json")
    ap.add_argument("--seq", action="append", required=True,
                    help="sequence length; repeat the flag or give a comma list")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per S (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON object per S on stdout")
    ap.add_argument("--bf16", action="store_true", help='the forward under torch.autocast("cpu", bfloat16)')
    ap.add_argument("--in-process", action="store_true",
                    help="run every S in this process (peak RSS then accumulates over S)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    try:
        seqs = parse_seqs(args.seq)
    except ValueError as e:
        ap.error(str(e))
    if args.batch <= 0 or args.threads <= 0 or args.steps <= 0 or args.warmup < 0:
        ap.error("--batch, --threads, --steps must be positive and --warmup >= 0")
    with open(args.config) as f:
        cfg = Cfg(json.load(f))

    if args.child:
        res = run_one(cfg, seqs[0], args.batch, args.threads, args.steps, args.warmup, args.seed, args.bf16)
        print(json.dumps(res), flush=True)
        return 0

    results = []
    for s in seqs:
        if cfg.max_pos and s > cfg.max_pos:
            print(f"warning: S={s} exceeds max_position_embeddings {cfg.max_pos}", file=sys.stderr)
        if args.in_process:
            res = run_one(cfg, s, args.batch, args.threads, args.steps, args.warmup, args.seed, args.bf16)
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--config", args.config,
                   "--seq", str(s), "--batch", str(args.batch), "--threads", str(args.threads),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)]
            if args.bf16:
                cmd.append("--bf16")
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                print(f"error: S={s} child exited {proc.returncode}", file=sys.stderr)
                return 1
            res = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(res)
        if args.json:
            print(json.dumps(res), flush=True)
        else:
            print(f"S={s}: {res['tokens_per_s']:.1f} tokens/s, median {res['step_s_median']:.3f} s/step, "
                  f"peak RSS {res['peak_rss_bytes'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)

    table = sys.stderr if args.json else sys.stdout
    print(f"\ntorch_peer (torch {torch.__version__}, {'bf16 autocast' if args.bf16 else 'fp32'}, materialized attention), "
          f"config {args.config}",
          file=table)
    hdr = f"{'seq':>6} {'batch':>5} {'thr':>3} {'tokens/s':>10} {'median s':>9} {'min s':>8} {'max s':>8} {'peak RSS':>10}"
    print(hdr, file=table)
    for r in results:
        print(f"{r['seq']:>6} {r['batch']:>5} {r['threads']:>3} {r['tokens_per_s']:>10.1f} "
              f"{r['step_s_median']:>9.3f} {r['step_s_min']:>8.3f} {r['step_s_max']:>8.3f} "
              f"{r['peak_rss_bytes'] / 1e9:>8.2f} GB", file=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
