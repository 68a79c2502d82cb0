"""Train the embedded tiny Llama-3 model on Jane Austen's novels and write it as a HF dir.

Reproduce (corpus first, see scripts/prepare_tiny_corpus.py for the package it reads):

    PYTHONPATH=. python3 scripts/prepare_tiny_corpus.py --austen_root=scratch/janeaustenr \
        --out_dir=scratch/tiny_corpus
    PYTHONPATH=. python3 scripts/train_tiny.py --corpus_dir=scratch/tiny_corpus \
        --out_dir=paxkv/assets/tiny --results_dir=results --seed=0

The model is the `tiny-random` preset's shape (4 layers, hidden 256, 8 query / 2 KV heads of
dim 32, SwiGLU 768, tied embeddings, RoPE) run through paxkv's own dense forward, so the
shipped weights need no conversion. AdamW with linear warmup and cosine decay (optax).

The corpus is small (~0.9M tokens), so the run length is chosen on the validation split:
one run per entry of --schedule_steps (same seed, each with its own full cosine schedule),
evaluating every --eval_every steps; the checkpoint with the lowest validation loss is
kept. The test split is scored once, with the shipped (bf16-rounded) weights.

Training windows start at a paragraph with <|begin_of_text|> prepended, as a prompt does.
A --chat_fraction of windows are Llama-3 chat transcripts built from consecutive
paragraphs (user: a paragraph, assistant: the next one, each turn ending in <|eot_id|>), so
that chat-formatted prompts get an answer that ends with <|eot_id|>.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
from typing import Any, Sequence

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from paxkv.sim.eval_windows import eval_windows  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("corpus_dir", "scratch/tiny_corpus", "Output of prepare_tiny_corpus.py.")
flags.DEFINE_string("out_dir", "paxkv/assets/tiny", "Where the HF checkpoint dir is written.")
flags.DEFINE_string("results_dir", "results", "Where tiny_loss.png and tiny_train_log.json go.")
flags.DEFINE_integer("seed", 0, "Seed of the initialization and of the batch order.")
flags.DEFINE_list("schedule_steps", ["200", "400", "800"],
                  "One training run per entry, each with a cosine schedule of that many steps.")
flags.DEFINE_integer("batch_size", 64, "Windows per step.")
flags.DEFINE_integer("seq_len", 512, "Tokens per training window.")
flags.DEFINE_float("peak_lr", 2e-3, "AdamW peak learning rate.")
flags.DEFINE_float("final_lr_ratio", 0.1, "Cosine decays to peak_lr * this.")
flags.DEFINE_float("warmup_fraction", 0.1, "Linear warmup, as a fraction of each run's steps.")
flags.DEFINE_float("weight_decay", 0.1, "AdamW decoupled weight decay (matrices only).")
flags.DEFINE_float("clip_norm", 1.0, "Global gradient norm clip.")
flags.DEFINE_float("chat_fraction", 0.15, "Fraction of windows formatted as chat transcripts.")
flags.DEFINE_integer("eval_every", 25, "Validation interval in steps.")
flags.DEFINE_float("max_seconds", 1e9, "Stop training (keeping the best so far) after this long.")
flags.DEFINE_integer("num_layers", 4, "Decoder layers.")
flags.DEFINE_integer("hidden_size", 256, "Model width.")
flags.DEFINE_integer("intermediate_size", 768, "SwiGLU width.")
flags.DEFINE_integer("num_heads", 8, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 2, "Key/value heads (GQA).")
flags.DEFINE_integer("head_dim", 32, "Per-head dimension.")
flags.DEFINE_integer("max_position_embeddings", 2048, "Longest context the config declares.")
flags.DEFINE_enum("save_dtype", "bfloat16", ["bfloat16", "float32"], "Dtype of the shipped weights.")
flags.DEFINE_integer("sample_tokens", 60, "Tokens per sample in the log.")

PROMPTS = (
    "It is a truth universally acknowledged, that",
    "Elizabeth looked at her sister, and",
    "\"My dear Emma,\" said Mr. Knightley,",
    "The next morning",
)
CHAT_PROMPT = "What do you think of Mr. Darcy?"
SHIPPED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json")


# ----------------------------------------------------------------------------------------
# Data
class Corpus:
    """Token streams of prepare_tiny_corpus.py plus the special ids the windows need."""

    def __init__(self, corpus_dir: str):
        from tokenizers import Tokenizer
        data = np.load(os.path.join(corpus_dir, "corpus.npz"))
        self.streams = {k: data[k].astype(np.int32) for k in ("train", "valid", "test")}
        self.spans = {k: data[f"{k}_spans"] for k in ("train", "valid", "test")}
        self.tokenizer_dir = os.path.join(corpus_dir, "tokenizer")
        self.tokenizer = Tokenizer.from_file(os.path.join(self.tokenizer_dir, "tokenizer.json"))
        tid = self.tokenizer.token_to_id
        self.bos, self.eos, self.eot = tid("<|begin_of_text|>"), tid("<|end_of_text|>"), tid("<|eot_id|>")
        enc = lambda s: self.tokenizer.encode(s, add_special_tokens=False).ids
        header = lambda role: [tid("<|start_header_id|>"), *enc(role), tid("<|end_header_id|>"), *enc("\n\n")]
        self.user_header, self.assistant_header = header("user"), header("assistant")
        self.vocab_size = self.tokenizer.get_vocab_size()


class WindowSampler:
    """Random training windows `[B, seq_len + 1]` (inputs = [:, :-1], targets = [:, 1:])."""

    def __init__(self, corpus: Corpus, seq_len: int, chat_fraction: float, seed: int):
        self.c, self.seq_len, self.chat_fraction = corpus, seq_len, chat_fraction
        self.stream, self.spans = corpus.streams["train"], corpus.spans["train"]
        self.starts = self.spans[self.spans[:, 0] + seq_len <= self.stream.size, 0]
        self.rng = np.random.default_rng(seed)

    def _plain(self, n: int) -> np.ndarray:
        starts = self.rng.choice(self.starts, size=n)
        body = self.stream[starts[:, None] + np.arange(self.seq_len)[None, :]]
        return np.concatenate([np.full((n, 1), self.c.bos, np.int32), body], axis=1)

    def _chat(self) -> np.ndarray:
        """A multi-turn transcript over consecutive paragraphs, cut to seq_len + 1 tokens."""
        max_turn = self.seq_len // 3
        i = int(self.rng.integers(len(self.spans)))
        out, turn = [self.c.bos], 0
        while len(out) < self.seq_len + 1:
            a, b = self.spans[(i + turn) % len(self.spans)]
            header = self.c.user_header if turn % 2 == 0 else self.c.assistant_header
            out += header + self.stream[a:min(b, a + max_turn)].tolist() + [self.c.eot]
            turn += 1
        return np.asarray(out[:self.seq_len + 1], np.int32)

    def batch(self, batch_size: int) -> np.ndarray:
        n_chat = int(self.rng.binomial(batch_size, self.chat_fraction))
        rows = [self._plain(batch_size - n_chat)] + [self._chat()[None] for _ in range(n_chat)]
        return np.concatenate(rows, axis=0)


# ----------------------------------------------------------------------------------------
# Model, loss, optimizer
def model_config(vocab_size: int, bos: int, eos_ids: Sequence[int]):
    from paxkv.config import ModelConfig
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=FLAGS.hidden_size,
        intermediate_size=FLAGS.intermediate_size, num_layers=FLAGS.num_layers,
        num_heads=FLAGS.num_heads, num_kv_heads=FLAGS.num_kv_heads, head_dim=FLAGS.head_dim,
        rope_theta=10000.0, max_position_embeddings=FLAGS.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=bos, eos_token_ids=tuple(eos_ids), name="tiny")


def token_nll(params: Any, windows, cfg):
    """Per-target negative log-likelihood `[B, T]` of windows `[B, T + 1]`."""
    import jax
    import jax.numpy as jnp
    from paxkv.model.dense import dense_forward
    logits, _ = dense_forward(params, windows[:, :-1], cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, windows[:, 1:, None], axis=-1)[..., 0]


def make_optimizer(weight_decay: float, clip_norm: float):
    import jax
    import optax
    decay_mask = lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, b1=0.9, b2=0.95, eps=1e-8,
                                              weight_decay=weight_decay, mask=decay_mask))


def lr_at(step: int, total: int, peak: float, final_ratio: float, warmup_fraction: float) -> float:
    """Linear warmup to `peak`, then cosine down to `peak * final_ratio` at `total`."""
    warmup = max(1, int(round(total * warmup_fraction)))
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + np.cos(np.pi * t)))


# ----------------------------------------------------------------------------------------
# Generation for the log (the dense path: paxkv.model.dense)
def generate(params: Any, cfg, prompt_ids: Sequence[int], max_new: int, temperature: float,
             seed: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """Greedy (temperature 0) or temperature + top-k 40 sampling on the dense KV cache."""
    import jax
    import jax.numpy as jnp
    from paxkv.model.dense import greedy_generate, init_cache
    from paxkv.model.layers import params_dtype
    if temperature == 0.0:
        return greedy_generate(params, cfg, prompt_ids, max_new, stop_token_ids=stop_ids)
    n = len(prompt_ids)
    cache = init_cache(cfg, 1, n + max_new, params_dtype(params))
    key = jax.random.key(seed)
    token, cache = _sample_step(params, jnp.asarray([prompt_ids], jnp.int32), cache,
                                jnp.zeros((1,), jnp.int32), jnp.int32(n - 1),
                                jax.random.fold_in(key, 0), jnp.float32(temperature), cfg)
    out = [int(token)]
    for step in range(1, max_new):
        if out[-1] in stop_ids:
            break
        token, cache = _sample_step(params, token.reshape(1, 1), cache,
                                    jnp.full((1,), n + step - 1, jnp.int32), jnp.int32(0),
                                    jax.random.fold_in(key, step), jnp.float32(temperature), cfg)
        out.append(int(token))
    return out


@functools.lru_cache(maxsize=None)
def _sample_step_fn():
    import jax
    import jax.numpy as jnp
    from paxkv.model.dense import dense_forward

    @functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
    def step(params, tokens, cache, start_pos, last, key, temperature, cfg):
        logits, cache = dense_forward(params, tokens, cfg, cache, start_pos)
        logits = logits[0, last] / temperature
        kth = jax.lax.top_k(logits, 40)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
        return jax.random.categorical(key, logits).astype(jnp.int32), cache
    return step


def _sample_step(*args):
    return _sample_step_fn()(*args)


def write_samples(params: Any, cfg, corpus: Corpus) -> list[dict]:
    tok = corpus.tokenizer
    samples = []
    for i, prompt in enumerate(PROMPTS):
        ids = [corpus.bos] + tok.encode(prompt, add_special_tokens=False).ids
        for temperature in (0.0, 0.8):
            new = generate(params, cfg, ids, FLAGS.sample_tokens, temperature, seed=i)
            samples.append({"prompt": prompt, "temperature": temperature,
                            "completion": tok.decode(new, skip_special_tokens=False)})
    chat = ([corpus.bos] + corpus.user_header + tok.encode(CHAT_PROMPT, add_special_tokens=False).ids
            + [corpus.eot] + corpus.assistant_header)
    new = generate(params, cfg, chat, 2 * FLAGS.sample_tokens, 0.8, seed=99,
                   stop_ids=(corpus.eot, corpus.eos))
    samples.append({"prompt": f"[chat] {CHAT_PROMPT}", "temperature": 0.8,
                    "completion": tok.decode(new, skip_special_tokens=False)})
    return samples


# ----------------------------------------------------------------------------------------
def save_hf_dir(params: Any, cfg, corpus: Corpus, out_dir: str) -> None:
    """Weights + config via paxkv's checkpoint writer, then tokenizer and generation config."""
    from paxkv.model.weights import save_checkpoint
    if os.path.isdir(out_dir):
        unexpected = set(os.listdir(out_dir)) - set(SHIPPED_FILES)
        if unexpected:
            raise ValueError(f"--out_dir={out_dir!r} holds files a checkpoint dir would not "
                             f"({sorted(unexpected)[:3]}); refusing to overwrite it")
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    save_checkpoint(params, cfg, out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(corpus.tokenizer_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids),
                   "do_sample": True, "temperature": 0.8, "top_k": 40,
                   "max_length": cfg.max_position_embeddings}, f, indent=2)
        f.write("\n")


def plot(runs: list[dict], best: dict, path: str, tokens_per_step: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for color, run in zip(("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"), runs):
        steps = np.asarray(run["train_steps"])
        loss = np.asarray(run["train_loss"])
        if loss.size:
            ax.plot(steps * tokens_per_step / 1e6, loss, color=color, alpha=0.35, lw=1)
        ev = np.asarray(run["eval_steps"])
        ax.plot(ev * tokens_per_step / 1e6, run["valid_loss"], color=color, marker="o", ms=3,
                label=f"{run['steps']}-step schedule: valid (train faint)")
    ax.axvline(best["step"] * tokens_per_step / 1e6, color="gray", ls=":", lw=1,
               label=f"kept: {best['steps']}-step run at step {best['step']}")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats / token)")
    seen = [v for run in runs for v in run["valid_loss"] + run["train_loss"]]
    ax.set_ylim(max(0.0, min(seen) - 0.2), min(8.6, max(seen) + 0.1))
    ax.set_title("tiny Llama-3 on Jane Austen (vocab 4096, uniform = 8.32 nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    import optax
    from tqdm import tqdm
    from paxkv.model.params import init_params

    t_start = time.time()
    corpus = Corpus(FLAGS.corpus_dir)
    cfg = model_config(corpus.vocab_size, corpus.bos, (corpus.eos, corpus.eot))
    print(f"devices: {jax.devices()}  params: {cfg.num_params():,}  "
          f"train tokens: {corpus.streams['train'].size:,}", flush=True)
    optimizer = make_optimizer(FLAGS.weight_decay, FLAGS.clip_norm)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, windows, lr):
        opt_state[1].hyperparams["learning_rate"] = lr
        loss, grads = jax.value_and_grad(lambda p: token_nll(p, windows, cfg).mean())(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def eval_sums(params, windows, mask):
        nll = token_nll(params, windows, cfg)
        return jnp.sum(nll * mask), jnp.sum(mask)

    def mean_nll(params, split: str) -> float:
        windows, mask = eval_windows(corpus.streams[split], corpus.bos, FLAGS.seq_len)
        total, count = 0.0, 0.0
        for i in range(0, len(windows), FLAGS.batch_size):
            s, c = eval_sums(params, jnp.asarray(windows[i:i + FLAGS.batch_size]),
                             jnp.asarray(mask[i:i + FLAGS.batch_size]))
            total, count = total + float(s), count + float(c)
        return total / count

    runs, best = [], {"valid_loss": float("inf")}
    schedules = [int(s) for s in FLAGS.schedule_steps]
    out_of_time = False
    for run_index, total in enumerate(schedules):
        if out_of_time:
            break
        key = jax.random.key(FLAGS.seed)
        params = init_params(cfg, key, jnp.float32)
        opt_state = optimizer.init(params)
        sampler = WindowSampler(corpus, FLAGS.seq_len, FLAGS.chat_fraction, FLAGS.seed)
        run = {"steps": total, "train_steps": [], "train_loss": [], "eval_steps": [],
               "valid_loss": [], "completed_steps": 0}
        pending = []
        t_run = time.time()
        bar = tqdm(range(total), desc=f"run {run_index + 1}/{len(schedules)} ({total} steps)",
                   mininterval=2.0)
        for step in bar:
            lr = lr_at(step, total, FLAGS.peak_lr, FLAGS.final_lr_ratio, FLAGS.warmup_fraction)
            windows = jnp.asarray(sampler.batch(FLAGS.batch_size))
            params, opt_state, loss = train_step(params, opt_state, windows, jnp.float32(lr))
            pending.append((step, loss))
            last = step + 1 == total
            if (step + 1) % FLAGS.eval_every == 0 or last:
                for s, l in pending:
                    run["train_steps"].append(s + 1)
                    run["train_loss"].append(float(l))
                pending = []
                valid = mean_nll(params, "valid")
                run["eval_steps"].append(step + 1)
                run["valid_loss"].append(valid)
                bar.set_postfix(train=f"{run['train_loss'][-1]:.3f}", valid=f"{valid:.3f}")
                if valid < best["valid_loss"]:
                    best = {"valid_loss": valid, "steps": total, "step": step + 1,
                            "params": jax.tree_util.tree_map(np.asarray, params)}
            run["completed_steps"] = step + 1
            if time.time() - t_start > FLAGS.max_seconds:
                out_of_time = True
                print(f"stopping: --max_seconds={FLAGS.max_seconds} reached", flush=True)
                break
        bar.close()
        run["seconds"] = time.time() - t_run
        runs.append(run)
        print(f"run {total}: best valid so far {best['valid_loss']:.4f} "
              f"({run['seconds']:.1f}s)", flush=True)

    params = jax.tree_util.tree_map(jnp.asarray, best.pop("params"))
    test_fp32 = mean_nll(params, "test")
    save_dtype = jnp.bfloat16 if FLAGS.save_dtype == "bfloat16" else jnp.float32
    save_hf_dir(jax.tree_util.tree_map(lambda p: p.astype(save_dtype), params), cfg, corpus,
                FLAGS.out_dir)

    # Everything below uses the shipped files, read back through paxkv's loader.
    from paxkv.model.weights import load_checkpoint
    loaded = load_checkpoint(FLAGS.out_dir, jnp.float32)
    shipped, shipped_cfg = (loaded if isinstance(loaded, tuple) else (loaded, cfg))
    test_shipped = mean_nll(shipped, "test")
    valid_shipped = mean_nll(shipped, "valid")
    samples = write_samples(shipped, shipped_cfg, corpus)

    os.makedirs(FLAGS.results_dir, exist_ok=True)
    tokens_per_step = FLAGS.batch_size * FLAGS.seq_len
    plot(runs, best, os.path.join(FLAGS.results_dir, "tiny_loss.png"), tokens_per_step)
    size = sum(os.path.getsize(os.path.join(FLAGS.out_dir, f)) for f in os.listdir(FLAGS.out_dir))
    log = {
        "flags": {f: FLAGS[f].value for f in (
            "seed", "schedule_steps", "batch_size", "seq_len", "peak_lr", "final_lr_ratio",
            "warmup_fraction", "weight_decay", "clip_norm", "chat_fraction", "eval_every",
            "save_dtype")},
        "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
        "num_params": cfg.num_params(), "tokens_per_step": tokens_per_step,
        "train_tokens": int(corpus.streams["train"].size),
        "valid_tokens": int(corpus.streams["valid"].size),
        "test_tokens": int(corpus.streams["test"].size),
        "kept": best,
        "test_nll_fp32": test_fp32, "test_ppl_fp32": float(np.exp(test_fp32)),
        "valid_nll_shipped": valid_shipped, "test_nll_shipped": test_shipped,
        "test_ppl_shipped": float(np.exp(test_shipped)),
        "uniform_ppl": cfg.vocab_size, "shipped_dir_bytes": size,
        "seconds_total": time.time() - t_start, "runs": runs, "samples": samples,
    }
    with open(os.path.join(FLAGS.results_dir, "tiny_train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(json.dumps({k: v for k, v in log.items() if k not in ("runs",)}, indent=1), flush=True)


if __name__ == "__main__":
    app.run(main)
