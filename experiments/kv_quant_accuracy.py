"""What 8-bit KV pages cost in accuracy, on held-out Austen text: the embedded tiny model's, or
a real model's (`--model smollm2-135m-instruct`, the split's text tokenized by its tokenizer).

Three measurements, each against the full-precision cache (float32 pages, the CPU's "auto"):

1. Through the quantized cache: held-out perplexity by chunked prefill on the paged model
   (`paxkv.model.forward.forward` over a real `KVPool` of each `kv_cache_dtype`). Every
   attention read, including a chunk's own tokens and every earlier chunk's, goes through
   quantized pages, as in serving. Also the mean KL divergence of each next-token
   distribution from the full-precision one, and how often the top-1 token agrees
   (teacher-forced, so one early difference does not cascade).
2. Greedy agreement through the engine: `LLM("tiny", kv_cache_dtype=...)` continues held-out
   paragraph openings greedily; its tokens are compared with the full-precision engine's,
   position by position and up to the first divergence.
3. Scale granularity: the same model with K/V quantized and dequantized inside dense
   attention (simulated), with one scale per (token, head) — what the pool stores — against
   one per (block of 16 tokens, head) computed from the finished block (an upper bound on
   the accuracy of any per-block scheme, which must fix or requantize a block's scale while
   it fills) and one static scale per (layer, head) calibrated on the valid split (vLLM's
   fp8 recipe). The per-token row doubles as a check that the simulation matches the pool.

    PYTHONPATH=. python3 experiments/kv_quant_accuracy.py
    PYTHONPATH=. python3 experiments/kv_quant_accuracy.py --max_windows=4 --num_prompts=8 \
        --out_dir=/tmp/kvq                                # a quick look
    PYTHONPATH=. python3 experiments/kv_quant_accuracy.py --model smollm2-135m-instruct \
        --granularity=false                                # the real model

The corpus comes from `scripts/prepare_tiny_corpus.py` (`--corpus_dir`, test split); any
text file works instead (`--text_file`).
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable

import numpy as np
from absl import app, flags
from tqdm import tqdm

import jax
import jax.numpy as jnp

from experiments import common
from paxkv.cache import kv_pool as kvp
from paxkv.cache import quant
from paxkv.config import ModelConfig
from paxkv.sim.eval_windows import eval_windows
from paxkv.model.batch import StepBatch
from paxkv.model.dense import grouped_attention
from paxkv.model.forward import forward
from paxkv.model.layers import DecoderLM

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "The model: 'tiny' (the corpus's own tokens), or a preset, "
                    "checkpoint dir or GGUF file (the split's text, tokenized by its tokenizer).")
flags.DEFINE_string("corpus_dir", "scratch/tiny_corpus", "Output of scripts/prepare_tiny_corpus.py.")
flags.DEFINE_string("text_file", None, "Held-out text to use instead of the corpus (tokenized "
                    "with the tiny model's tokenizer; paragraphs split on blank lines).")
flags.DEFINE_string("split", "test", "Corpus split to evaluate.")
flags.DEFINE_string("calib_split", "valid", "Corpus split the static per-layer scales are "
                    "calibrated on (the text file's first half with --text_file).")
flags.DEFINE_list("kv_dtypes", ["bfloat16", "fp8", "fp8_e5m2", "int8"],
                  "kv_cache_dtypes compared against float32 pages.")
flags.DEFINE_integer("seq_len", 512, "Tokens predicted per window (each window is bos + seq_len).")
flags.DEFINE_integer("chunk", 64, "Chunked-prefill chunk: later chunks read earlier chunks' K/V "
                     "from the quantized pages.")
flags.DEFINE_integer("block_size", 16, "KV block size (also the per-block scale's group).")
flags.DEFINE_integer("batch_windows", 8, "Windows per forward call.")
flags.DEFINE_integer("max_windows", None, "Evaluate only the first N windows.")
flags.DEFINE_integer("num_prompts", 128, "Held-out paragraph openings for greedy agreement.")
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens (bos + paragraph opening).")
flags.DEFINE_integer("max_tokens", 64, "Greedy tokens generated per prompt.")
flags.DEFINE_bool("granularity", True, "Run the scale-granularity study (measurement 3).")
flags.DEFINE_string("out_dir", "scratch/results", "Where kv_quant_accuracy.json/.md/.png go (--out_dir=results updates the committed results)")
flags.DEFINE_integer("seed", 0, "Seed of the block-table permutation.")

NAME = "kv_quant_accuracy"
FULL = "float32"                     # the reference cache: float32 pages (CPU "auto")
QUANTIZED = ("fp8", "fp8_e5m2", "int8")
GRANULARITIES = ("token", "token_f32", "block", "layer_static")
GRANULARITY_LABELS = {
    "token": "per (token, head), bf16 scale [pool]",
    "token_f32": "per (token, head), fp32 scale",
    "block": "per (block of 16, head), oracle",
    "layer_static": "per (layer, head), static (calibrated)",
}


# ---- data -------------------------------------------------------------------------------
def load_text(tokenizer: Any, bos: int) -> dict[str, Any]:
    """Token streams of the eval and calibration splits and the eval split's paragraphs."""
    if FLAGS.text_file:
        with open(FLAGS.text_file) as f:
            paras = [p.strip() for p in f.read().split("\n\n") if p.strip()]
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in paras]
        half = max(1, len(ids) // 2)
        return {"eval": np.concatenate([np.asarray(x) for x in ids]).astype(np.int32),
                "calib": np.concatenate([np.asarray(x) for x in ids[:half]]).astype(np.int32),
                "paragraphs": ids, "source": os.path.basename(FLAGS.text_file)}
    if FLAGS.model != "tiny":   # another tokenizer: the split's text, not its tiny-model ids
        def split_ids(split: str) -> list[list[int]]:
            path = os.path.join(FLAGS.corpus_dir, f"{split}.txt")
            if not os.path.exists(path):
                raise ValueError(f"--corpus_dir: {path} not found; build it with "
                                 "scripts/prepare_tiny_corpus.py or pass --text_file")
            with open(path) as f:
                paras = [p.strip() for p in f.read().split("\n\n") if p.strip()]
            return [tokenizer.encode(p, add_special_tokens=False) for p in paras]
        ids, calib = split_ids(FLAGS.split), split_ids(FLAGS.calib_split)
        return {"eval": np.concatenate([np.asarray(x) for x in ids]).astype(np.int32),
                "calib": np.concatenate([np.asarray(x) for x in calib]).astype(np.int32),
                "paragraphs": ids, "source": f"Austen corpus, {FLAGS.split} split"}
    path = os.path.join(FLAGS.corpus_dir, "corpus.npz")
    if not os.path.exists(path):
        raise ValueError(f"--corpus_dir: {path} not found; build it with "
                         "scripts/prepare_tiny_corpus.py (see results/tiny_model.md) or pass "
                         "--text_file")
    data = np.load(path)
    stream = data[FLAGS.split].astype(np.int32)
    paras = [stream[a:b].tolist() for a, b in data[f"{FLAGS.split}_spans"]]
    return {"eval": stream, "calib": data[FLAGS.calib_split].astype(np.int32),
            "paragraphs": paras, "source": f"tiny corpus, {FLAGS.split} split"}


# ---- 1. perplexity through the paged, quantized cache -------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("pool",))
def _chunk_logprobs(params, batch: StepBatch, pool: kvp.KVPool, cfg: ModelConfig):
    logits, pool = forward(params, batch, pool, cfg, backend="reference", all_logits=True)
    return jax.nn.log_softmax(logits, axis=-1), pool


def paged_logprobs(params, cfg: ModelConfig, inputs: np.ndarray, kv_cache_dtype: str,
                   rng: np.random.Generator) -> jax.Array:
    """Log-probabilities `[S, L, vocab]` of windows `[S, L]` by chunked prefill through a
    fresh pool of `kv_cache_dtype` (pages in a random order, as a long-running pool has)."""
    s, length = inputs.shape
    bs, chunk = FLAGS.block_size, FLAGS.chunk
    per_seq = math.ceil(length / bs)
    pool = kvp.init_pool(cfg, 1 + s * per_seq, bs, jnp.float32, kv_cache_dtype)
    tables = rng.permutation(np.arange(1, 1 + s * per_seq)).reshape(s, per_seq).astype(np.int32)
    out = []
    for c0 in range(0, length, chunk):
        n = min(chunk, length - c0)
        pos = np.tile(np.arange(c0, c0 + n, dtype=np.int32), s)
        seq = np.repeat(np.arange(s), n)
        batch = StepBatch(
            token_ids=jnp.asarray(inputs[:, c0:c0 + n].reshape(-1)),
            positions=jnp.asarray(pos),
            slot_mapping=jnp.asarray(tables[seq, pos // bs] * bs + pos % bs),
            block_tables=jnp.asarray(tables),
            context_lens=jnp.full((s,), c0 + n, jnp.int32),
            cu_q_lens=jnp.arange(s + 1, dtype=jnp.int32) * n,
            logits_indices=jnp.arange(1, s + 1, dtype=jnp.int32) * n - 1)
        logp, pool = _chunk_logprobs(params, batch, pool, cfg)
        out.append(logp.reshape(s, n, -1))
    return jnp.concatenate(out, axis=1)


@jax.jit
def _compare(logp: jax.Array, ref_logp: jax.Array, targets: jax.Array, mask: jax.Array):
    """Sums over masked targets: NLL, KL(ref || this), top-1 agreement with ref."""
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)
    agree = (jnp.argmax(logp, -1) == jnp.argmax(ref_logp, -1)).astype(jnp.float32)
    return jnp.stack([jnp.sum(nll * mask), jnp.sum(kl * mask), jnp.sum(agree * mask)])


class Sums:
    """Running sums of (nll, kl, top-1 agreement) over targets, per configuration."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self.count = 0.0

    def add(self, name: str, stats: jax.Array) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + np.asarray(stats, np.float64)

    def row(self, name: str) -> dict[str, float]:
        nll, kl, agree = self.sums[name] / self.count
        return {"nll": nll, "ppl": math.exp(nll), "kl": kl, "top1_agreement": agree}


def perplexity_through_cache(params, cfg, windows, mask, dtypes) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(FLAGS.seed)
    sums = Sums()
    bw = FLAGS.batch_windows
    for i in tqdm(range(0, len(windows), bw), desc="perplexity through the cache"):
        w, m = windows[i:i + bw], jnp.asarray(mask[i:i + bw])
        targets = jnp.asarray(w[:, 1:])
        ref = paged_logprobs(params, cfg, w[:, :-1], FULL, rng)
        sums.count += float(m.sum())
        sums.add(FULL, _compare(ref, ref, targets, m))
        for d in dtypes:
            sums.add(d, _compare(paged_logprobs(params, cfg, w[:, :-1], d, rng), ref, targets, m))
    return {name: sums.row(name) for name in [FULL, *dtypes]}


# ---- 3. scale granularity (simulated inside dense attention) -----------------------------
def _qdq(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """Quantize `x` against a broadcastable float32 `scale` and dequantize (codes clip)."""
    top = quant.qmax(dtype)
    y = jnp.clip(x / jnp.where(scale > 0, scale, 1.0), -top, top)
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype).astype(jnp.float32) * scale


def fake_quant(x: jax.Array, dtype: Any, granularity: str, block_size: int,
               static_amax: jax.Array | None = None) -> jax.Array:
    """K or V `[B, T, H, d]` (T a multiple of block_size, position 0 at a block start)
    quantized and dequantized with one scale per `granularity` group."""
    x = x.astype(jnp.float32)
    if granularity == "token":
        return quant.dequantize(*quant.quantize(x, dtype))
    if granularity == "token_f32":
        return quant.dequantize(*quant.quantize(x, dtype, jnp.float32))
    top = quant.qmax(dtype)
    if granularity == "block":
        b, t, h, d = x.shape
        xb = x.reshape(b, t // block_size, block_size, h, d)
        scale = jnp.max(jnp.abs(xb), axis=(2, 4), keepdims=True) / top
        return _qdq(xb, scale, dtype).reshape(b, t, h, d)
    if granularity == "layer_static":
        return _qdq(x, (static_amax / top)[None, None, :, None], dtype)
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def dense_logprobs(params, cfg: ModelConfig, inputs: jax.Array,
                   transform: Callable[[int, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]):
    """Causal dense forward whose attention sees `transform(layer, k, v)` instead of k, v;
    also returns per-layer sums (|dk|^2, |k|^2, |dv|^2, |v|^2) and the amax of k, v per head."""
    b, t = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    scale = cfg.head_dim ** -0.5

    def attention(layer, q, k, v, stats):
        kq, vq = transform(layer, k, v)
        kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
        err = jnp.stack([jnp.sum((kq - kf) ** 2), jnp.sum(kf ** 2),
                         jnp.sum((vq - vf) ** 2), jnp.sum(vf ** 2)])
        amax = jnp.stack([jnp.max(jnp.abs(kf), axis=(0, 1, 3)), jnp.max(jnp.abs(vf), axis=(0, 1, 3))])
        stats = (stats[0] + (err,), stats[1] + (amax,))
        return grouped_attention(q, kq.astype(q.dtype), vq.astype(q.dtype), positions,
                                 positions[0], scale), stats

    model = DecoderLM(cfg, jnp.float32)
    logits, (errs, amaxes) = model.apply({"params": params}, inputs, positions, attention, ((), ()))
    return jax.nn.log_softmax(logits, -1), jnp.stack(errs), jnp.stack(amaxes)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "granularity"))
def _dense_run(params, inputs, static_amax, cfg, dtype, granularity):
    if dtype is None:
        transform = lambda layer, k, v: (k.astype(jnp.float32), v.astype(jnp.float32))  # noqa: E731
    else:
        def transform(layer, k, v):
            sk = None if static_amax is None else static_amax[layer, 0]
            sv = None if static_amax is None else static_amax[layer, 1]
            return (fake_quant(k, dtype, granularity, FLAGS.block_size, sk),
                    fake_quant(v, dtype, granularity, FLAGS.block_size, sv))
    return dense_logprobs(params, cfg, inputs, transform)


def calibrate_amax(params, cfg, windows) -> jax.Array:
    """Max |K|, |V| per (layer, head) over calibration windows `[N, L]`: `[layers, 2, heads]`."""
    amax = None
    for i in tqdm(range(0, len(windows), FLAGS.batch_windows), desc="calibrating static scales"):
        _, _, a = _dense_run(params, jnp.asarray(windows[i:i + FLAGS.batch_windows]), None,
                             cfg=cfg, dtype=None, granularity="token")
        amax = a if amax is None else jnp.maximum(amax, a)
    return amax


def granularity_study(params, cfg, windows, mask, calib_windows) -> list[dict[str, Any]]:
    static_amax = calibrate_amax(params, cfg, calib_windows)
    formats = [d for d in QUANTIZED if d in FLAGS.kv_dtypes]
    configs = [(jnp.dtype(quant.storage_dtype(d)), d, g) for d in formats for g in GRANULARITIES]
    sums = Sums()
    errs: dict[str, np.ndarray] = {}
    for i in tqdm(range(0, len(windows), FLAGS.batch_windows), desc="scale granularity"):
        w = jnp.asarray(windows[i:i + FLAGS.batch_windows])
        m = jnp.asarray(mask[i:i + FLAGS.batch_windows])
        targets = w[:, 1:]
        ref, _, _ = _dense_run(params, w[:, :-1], None, cfg=cfg, dtype=None, granularity="token")
        sums.count += float(m.sum())
        sums.add("dense", _compare(ref, ref, targets, m))
        for dtype, name, g in configs:
            logp, e, _ = _dense_run(params, w[:, :-1], static_amax if g == "layer_static" else None,
                                    cfg=cfg, dtype=dtype, granularity=g)
            key = f"{name}/{g}"
            sums.add(key, _compare(logp, ref, targets, m))
            errs[key] = errs.get(key, 0.0) + np.asarray(e, np.float64).sum(axis=0)
    base = sums.row("dense")
    rows = []
    for _, name, g in configs:
        key = f"{name}/{g}"
        e = errs[key]
        rows.append({"kv_cache_dtype": name, "granularity": g, **sums.row(key),
                     "ppl_increase": sums.row(key)["ppl"] / base["ppl"] - 1.0,
                     "k_rel_rms_err": math.sqrt(e[0] / e[1]), "v_rel_rms_err": math.sqrt(e[2] / e[3]),
                     "scale_bytes_per_token_head": scale_bytes(g, FLAGS.block_size)})
    return [{"kv_cache_dtype": FULL, "granularity": "none", **base}] + rows


def scale_bytes(granularity: str, block_size: int) -> float:
    """Scale bytes per (token, head) of one of K or V, scales stored in bf16 (the per-block
    oracle is simulated with float32 scales: that only flatters it)."""
    return {"token": 2.0, "token_f32": 4.0, "block": 2.0 / block_size, "layer_static": 0.0}[granularity]


# ---- 2. greedy agreement through the engine ----------------------------------------------
def greedy_agreement(model_dir, params, prompts, dtypes) -> dict[str, dict[str, float]]:
    from paxkv import LLM, SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=FLAGS.max_tokens, ignore_eos=True)
    outs = {}
    for d in tqdm(["auto", *dtypes], desc="greedy through the engine"):
        llm = LLM(model_dir, dtype="float32", kv_cache_dtype=d, params=params,
                  max_model_len=FLAGS.prompt_len + FLAGS.max_tokens + 16,
                  num_gpu_blocks_override=len(prompts) * math.ceil(
                      (FLAGS.prompt_len + FLAGS.max_tokens) / 16) + 8,
                  max_num_seqs=64, max_num_batched_tokens=2048, attention_backend="reference")
        outs[d] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        bm = llm.llm_engine.block_manager
        if bm.num_used_blocks:
            raise RuntimeError(f"kv_cache_dtype={d}: {bm.num_used_blocks} blocks leaked")
    res = {}
    for d in dtypes:
        res[d] = agreement(outs["auto"], outs[d])
    return res


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Token-level agreement of greedy continuations: position by position, up to the first
    divergence (mean share of each continuation), and whole continuations."""
    same = total = prefix = exact = first_tok = 0
    prefix_share = []
    for a, b in zip(ref, other):
        first_tok += int(a[:1] == b[:1])
        n = min(len(a), len(b))
        eq = [x == y for x, y in zip(a[:n], b[:n])]
        same += sum(eq)
        total += max(len(a), len(b))
        first = eq.index(False) if False in eq else n
        prefix += first
        prefix_share.append(first / max(len(a), 1))
        exact += int(a == b)
    return {"first_token_agreement": first_tok / len(ref), "token_agreement": same / total,
            "prefix_agreement": float(np.mean(prefix_share)), "exact_match": exact / len(ref),
            "num_sequences": len(ref)}


# ---- report -------------------------------------------------------------------------------
def bytes_row(cfg: ModelConfig, name: str) -> dict[str, float]:
    """Bytes per token (pages + scales) for the model measured (keyed "tiny") and Llama-3-8B,
    and the gain in tokens per gigabyte over bf16 pages."""
    from paxkv.config import PRESETS
    out = {}
    for label, c in (("tiny", cfg), ("llama3_8b", PRESETS["llama3-8b"])):
        dt = quant.storage_dtype(name if name != FULL else "float32")
        pages, scales = quant.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dt)
        bf16, _ = quant.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, jnp.bfloat16)
        out[f"{label}_bytes_per_token"] = pages + scales
        out[f"{label}_tokens_per_gb_vs_bf16"] = bf16 / (pages + scales)
    return out


def render(results: dict[str, Any], settings: dict[str, Any]) -> tuple[str, str]:
    ppl, greedy = results["through_cache"], results["greedy"]
    base = ppl[FULL]
    head = ["KV pages", "bytes/token (this model)", "tokens/GB vs bf16 (this model / 8B)", "perplexity",
            "ppl change", "mean KL (nats)", "top-1 agree", "greedy 1st token",
            "greedy token agree", "greedy prefix agree", "greedy exact"]
    rows = []
    for name, r in ppl.items():
        b = results["bytes"][name]
        g = greedy.get(name)
        rows.append([
            name if name != FULL else "float32 (reference)", int(b["tiny_bytes_per_token"]),
            f"{b['tiny_tokens_per_gb_vs_bf16']:.2f}x / {b['llama3_8b_tokens_per_gb_vs_bf16']:.2f}x",
            f"{r['ppl']:.3f}", f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%", f"{r['kl']:.2e}",
            common.pct(r["top1_agreement"], 2),
            common.pct(g["first_token_agreement"], 1) if g else "-",
            common.pct(g["token_agreement"], 1) if g else "-",
            common.pct(g["prefix_agreement"], 1) if g else "-",
            common.pct(g["exact_match"], 0) if g else "-"])
    table = common.markdown_table(head, rows)
    notes = [f"Held-out text: {settings['source']}, {settings['num_windows']} windows of bos + "
             f"{settings['seq_len']} tokens ({settings['num_targets']} predicted tokens), chunked "
             f"prefill in chunks of {settings['chunk']} through a paged pool (block "
             f"{settings['block_size']}, pages in random order). Greedy: {settings['num_prompts']} "
             f"held-out paragraph openings of {settings['prompt_len']} tokens, "
             f"{settings['max_tokens']} tokens each, through `LLM(kv_cache_dtype=...)`; "
             "agreement is against the float32-page engine. Model weights are float32 ("
             + settings.get("weights", "the shipped bf16 values") + ")."]
    if results.get("granularity"):
        g_rows = []
        for r in results["granularity"]:
            if r["granularity"] == "none":
                continue
            g_rows.append([r["kv_cache_dtype"], GRANULARITY_LABELS[r["granularity"]],
                           f"{r['scale_bytes_per_token_head']:g}", f"{r['k_rel_rms_err']:.2e}",
                           f"{r['v_rel_rms_err']:.2e}", f"{r['ppl']:.3f}",
                           f"{100 * r['ppl_increase']:+.2f}%", f"{r['kl']:.2e}",
                           common.pct(r["top1_agreement"], 2)])
        dense = results["granularity"][0]
        notes.append("Scale granularity (K/V quantized and dequantized inside dense attention; "
                     f"unquantized perplexity {dense['ppl']:.3f}). Scale bytes are per (token, "
                     "head) of K or of V, against head_dim (here 32, Llama-3-8B 128) code bytes.\n\n"
                     + common.markdown_table(
                         ["KV pages", "scale", "scale bytes", "K rel. RMS err", "V rel. RMS err",
                          "perplexity", "ppl change", "mean KL", "top-1 agree"], g_rows))
    return table, "\n\n".join(notes)


def plot(results: dict[str, Any]):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    names = [n for n in results["through_cache"] if n != FULL]
    base = results["through_cache"][FULL]["ppl"]
    axes[0].bar(names, [100 * (results["through_cache"][n]["ppl"] / base - 1) for n in names])
    axes[0].set_ylabel("perplexity change vs float32 pages (%)")
    axes[0].set_title("through the paged cache")
    if results.get("granularity"):
        width = 0.2
        formats = list(dict.fromkeys(r["kv_cache_dtype"] for r in results["granularity"][1:]))
        for j, g in enumerate(GRANULARITIES):
            vals = [next(r["kl"] for r in results["granularity"]
                         if r["kv_cache_dtype"] == d and r["granularity"] == g) for d in formats]
            axes[1].bar(np.arange(len(formats)) + (j - 1.5) * width, vals, width,
                        label=GRANULARITY_LABELS[g])
        axes[1].set_xticks(np.arange(len(formats)), formats)
        axes[1].set_yscale("log")
        axes[1].set_ylabel("mean KL from float32 (nats/token)")
        axes[1].set_title("scale granularity (simulated)")
        axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def hardware() -> str:
    if jax.default_backend() == "cpu":
        import platform
        return (f"CPU ({platform.machine()}, {os.cpu_count()} cores), JAX {jax.__version__}, "
                "float32 weights and activations")
    return common.device_hardware()


def main(argv):
    del argv
    from paxkv.builder import resolve_model
    from paxkv.model.weights import load_checkpoint
    from paxkv.tokenizer import load_tokenizer
    model_dir, _ = resolve_model(FLAGS.model)
    if model_dir is None:
        raise ValueError(f"--model {FLAGS.model!r} names no checkpoint (the tiny model is "
                         "trained by scripts/train_tiny.py)")
    for d in FLAGS.kv_dtypes:
        quant.storage_dtype(d)   # ValueError naming the field on a bad name
    if FLAGS.seq_len % FLAGS.block_size:
        raise ValueError("--seq_len must be a multiple of --block_size")
    params, cfg = load_checkpoint(model_dir, dtype="float32")
    tok = load_tokenizer(model_dir)
    bos = cfg.bos_token_id
    text = load_text(tok, bos)
    windows, mask = eval_windows(text["eval"], bos, FLAGS.seq_len)
    if FLAGS.max_windows:
        windows, mask = windows[:FLAGS.max_windows], mask[:FLAGS.max_windows]
    calib, _ = eval_windows(text["calib"], bos, FLAGS.seq_len)
    calib = calib[:, :-1][: max(1, len(windows))]
    paras = [p for p in text["paragraphs"] if len(p) >= FLAGS.prompt_len - 1]
    prompts = [[bos] + list(p[:FLAGS.prompt_len - 1]) for p in paras[:FLAGS.num_prompts]]
    settings = {"source": text["source"], "num_windows": len(windows), "seq_len": FLAGS.seq_len,
                "num_targets": int(mask.sum()), "chunk": FLAGS.chunk,
                "block_size": FLAGS.block_size, "num_prompts": len(prompts),
                "prompt_len": FLAGS.prompt_len, "max_tokens": FLAGS.max_tokens,
                "kv_dtypes": list(FLAGS.kv_dtypes), "scale_dtype": jnp.dtype(quant.SCALE_DTYPE).name,
                "calibration_windows": len(calib), "seed": FLAGS.seed,
                "weights": ("the shipped bf16 values" if FLAGS.model == "tiny" else
                            "the checkpoint's values, dequantized where it stores them quantized")}

    results: dict[str, Any] = {}
    results["through_cache"] = perplexity_through_cache(params, cfg, windows, mask, FLAGS.kv_dtypes)
    results["greedy"] = greedy_agreement(model_dir, params, prompts, FLAGS.kv_dtypes)
    results["bytes"] = {n: bytes_row(cfg, n) for n in results["through_cache"]}
    if FLAGS.granularity:
        results["granularity"] = granularity_study(params, cfg, windows, mask, calib)
    table, notes = render(results, settings)
    print(table)
    print(notes)
    label = "the tiny model" if FLAGS.model == "tiny" else cfg.name
    name = NAME if FLAGS.model == "tiny" else f"{NAME}_{FLAGS.model.replace('-', '_')}"
    paths = common.write_results(
        name, FLAGS.out_dir, title=f"KV-cache quantization: accuracy on {label}",
        command=common.command_line(), hardware=hardware(), settings=settings,
        results=results, table=table, notes=notes, figure=plot(results))
    print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
    app.run(main)
