"""Train an EAGLE draft head (`paxkv/spec_decode/eagle.py`) for the real model on text it
generates itself, with optax, and measure what it would draft.

1. Prompts from Austen passages (the corpus `scripts/prepare_tiny_corpus.py` prepares, its
   validation split), eight instructions each: continue, summarise, rewrite, list the
   people, correct (a copy with misspellings), copy line by line, quote and explain, ask
   and answer questions.
2. The target answers them greedily through the engine (`LLM.chat`); its features (the
   final norm's output at every position) come from the dense forward.
3. The head trains on windows of `eagle.WINDOW` positions: smooth L1 on the next feature
   plus 0.1 x cross-entropy against the target's next-token distribution (EAGLE-1).
4. Acceptance, offline and exact for greedy decoding: along the target's greedy answers to
   the 16 held-out prompts of `experiments/spec_prompts.py`, each verify step keeps the
   head's drafts that equal the target's tokens (as `experiments/spec_acceptance.py` does
   for n-gram lookup); tokens per verify step by kind of prompt.

    PYTHONPATH=. python3 scripts/train_eagle.py --corpus_dir=CORPUS --out_dir=DIR    # CPU, ~30 min
    PYTHONPATH=. python3 scripts/train_eagle.py --smoke --out_dir=DIR                # tiny model, 1 min

Writes eagle_head.safetensors (the head's weights), train_eagle.{json,md,png} (loss curve,
acceptance table).
"""
from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "the target: preset, checkpoint or GGUF file")
flags.DEFINE_string("corpus_dir", "scratch/tiny_corpus", "prepare_tiny_corpus.py's output (valid.txt)")
flags.DEFINE_integer("num_prompts", 192, "training prompts (passages x instructions)")
flags.DEFINE_integer("max_tokens", 192, "answer tokens per training prompt at most")
flags.DEFINE_integer("steps", 400, "optimizer steps")
flags.DEFINE_integer("batch", 8, "windows per step")
flags.DEFINE_float("learning_rate", 1e-3, "AdamW peak learning rate (cosine decay)")
flags.DEFINE_integer("cls_rows", 32, "positions per window where the token loss runs")
flags.DEFINE_integer("k", 4, "drafts per verify step in the acceptance replay")
flags.DEFINE_integer("seed", 0, "initialisation and window sampling")
flags.DEFINE_bool("smoke", False, "the tiny model, a few prompts and steps (CPU check)")
flags.DEFINE_string("out_dir", "scratch/eagle", "where the head, json, markdown and png go")

INSTRUCTIONS = ["Continue this passage for a few sentences:\n\n{}",
                "Summarize this passage in two sentences:\n\n{}",
                "Rewrite this passage in modern English:\n\n{}",
                "List the people named in this passage and say what each does:\n\n{}",
                "Correct the spelling and grammar of this text:\n\n{typos}",
                "Copy this passage, putting each sentence on its own line:\n\n{}",
                "Quote the longest sentence of this passage, then explain it simply:\n\n{}",
                "Ask three questions about this passage and answer each:\n\n{}"]


def with_typos(text: str, seed: int) -> str:
    """Every eighth word misspelt (two letters swapped): text for a correcting prompt."""
    import random
    rng = random.Random(seed)
    words = text.split(" ")
    for i in range(rng.randrange(8), len(words), 8):
        w = words[i]
        if len(w) > 3:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def passages(corpus_dir: str, n: int) -> list[str]:
    """`n` passages of 300-700 characters from the corpus' validation split."""
    path = os.path.join(corpus_dir, "valid.txt")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: prepare the corpus first (scripts/prepare_tiny_corpus.py, "
                         "see its docstring), or pass --corpus_dir")
    text = open(path, encoding="utf-8").read()
    paras = [p.strip().replace("\n", " ") for p in text.split("\n\n")]
    paras = [p for p in paras if 300 <= len(p) <= 700]
    step = max(1, len(paras) // n)
    return paras[::step][:n]


def features_of(params, cfg, ids: list[int]):
    """The target's final-norm output at every position of `ids` -> `[len, h]` numpy."""
    import jax.numpy as jnp
    import numpy as np

    from paxkv.model.dense import dense_forward_jit
    n = len(ids)
    padded = -(-n // 64) * 64          # a few lengths compile, padding sits after the real ones
    tokens = jnp.asarray([ids + [0] * (padded - n)], jnp.int32)
    _, _, hidden = dense_forward_jit(params, tokens, cfg, hidden_layers=(cfg.num_layers,))
    return np.asarray(hidden[:n, 0])


def replay(head, cfg, embedding, feats, tokens, n0: int, k: int, draft_fn) -> dict:
    """Greedy speculation with the head along `tokens` (prompt and the target's greedy
    answer, answer from `n0`): verify steps, drafts proposed and kept."""
    import numpy as np

    from paxkv.spec_decode.eagle import WINDOW
    steps, proposed, kept = 1, 0, 0          # the first answer token comes from the prefill
    n = n0                                   # tokens[n] is the newest emitted token
    h = feats.shape[1]
    while n + 1 < len(tokens):
        room = min(k, len(tokens) - n - 1)
        lo = max(0, n - WINDOW)
        f = np.zeros((WINDOW, h), np.float32)
        t = np.zeros((WINDOW,), np.int32)
        real = n - lo
        f[WINDOW - real:] = feats[lo:n]
        t[WINDOW - real:] = tokens[lo + 1:n + 1]
        drafts = np.asarray(draft_fn(head, embedding, f, t, real))[:room]
        match = 0
        while match < len(drafts) and drafts[match] == tokens[n + 1 + match]:
            match += 1
        steps += 1
        proposed += len(drafts)
        kept += match
        n += match + 1
    return {"steps": steps, "tokens": len(tokens) - n0, "proposed": proposed, "kept": kept}


def main(argv):
    del argv
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm import tqdm

    from experiments.common import command_line, host_hardware, markdown_table, pct, write_results
    from experiments.spec_prompts import PROMPTS
    from paxkv import LLM, SamplingParams
    from paxkv.builder import resolve_model
    from paxkv.model.weights import load_checkpoint, write_safetensors
    from paxkv.spec_decode import eagle

    t_start = time.perf_counter()
    model = "tiny" if FLAGS.smoke else FLAGS.model
    num_prompts, max_tokens, steps = ((8, 24, 20) if FLAGS.smoke else
                                      (FLAGS.num_prompts, FLAGS.max_tokens, FLAGS.steps))
    llm = LLM(model, max_model_len=1024)
    if FLAGS.smoke:   # the tiny model has no chat template: plain text prompts
        texts = [p for kind in PROMPTS for p in PROMPTS[kind]][:num_prompts]
        outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                            use_tqdm=False)
        held_out = {kind: PROMPTS[kind][:1] for kind in PROMPTS}
    else:
        paras = passages(FLAGS.corpus_dir, -(-num_prompts // len(INSTRUCTIONS)))
        convs = [[{"role": "user", "content": ins.format(p, typos=with_typos(p, i))}]
                 for i, p in enumerate(paras) for ins in INSTRUCTIONS]
        outs = llm.chat(convs[:num_prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=True)
        held_out = PROMPTS
    train_seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    gen_s = time.perf_counter() - t_start

    source, cfg = resolve_model(model)
    params, cfg = load_checkpoint(source, dtype="float32") if source else (
        llm.llm_engine.runner.params, cfg)
    embedding = jnp.asarray(params["embed_tokens"]["embedding"], jnp.float32)
    feats = [features_of(params, cfg, s) for s in tqdm(train_seqs, desc="target features")]

    # Training windows: WINDOW positions from a random start, padded at the right.
    w = eagle.WINDOW
    rng = np.random.default_rng(FLAGS.seed)

    def batch():
        f = np.zeros((FLAGS.batch, w, cfg.hidden_size), np.float32)
        t = np.zeros((FLAGS.batch, w), np.int32)
        m = np.zeros((FLAGS.batch, w), np.float32)
        for b in range(FLAGS.batch):
            i = rng.integers(len(train_seqs))
            n = len(train_seqs[i])
            start = rng.integers(0, max(1, n - w))
            end = min(n, start + w)
            f[b, :end - start] = feats[i][start:end]
            t[b, :end - start] = train_seqs[i][start:end]
            m[b, :end - start] = 1.0
        rows = np.sort(np.stack([rng.choice(w - 1, FLAGS.cls_rows, replace=False)
                                 for _ in range(FLAGS.batch)]), axis=1)
        return jnp.asarray(f), jnp.asarray(t), jnp.asarray(m), jnp.asarray(rows, jnp.int32)

    head = eagle.init_head(cfg, jax.random.PRNGKey(FLAGS.seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.learning_rate, max(1, steps // 20), steps)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = opt.init(head)

    @jax.jit
    def train_step(head, opt_state, embedding, f, t, m, rows):   # the embedding an argument,
        (loss, aux), grads = jax.value_and_grad(eagle.eagle_loss, has_aux=True)(  # not a constant
            head, cfg, embedding, f, t, m, rows)
        updates, opt_state = opt.update(grads, opt_state, head)
        return optax.apply_updates(head, updates), opt_state, loss, aux

    curve = []
    t_train = time.perf_counter()
    for step in tqdm(range(steps), desc="training"):
        head, opt_state, loss, aux = train_step(head, opt_state, embedding, *batch())
        curve.append({"step": step, "loss": float(loss), **{k: float(v) for k, v in aux.items()}})
    train_s = time.perf_counter() - t_train

    # Acceptance on the held-out prompts (greedy).
    draft_fn = jax.jit(functools.partial(eagle.draft, target=cfg, k=FLAGS.k),
                       static_argnames=())
    sp = SamplingParams(temperature=0.0, max_tokens=160)
    per_kind = {}
    for kind, prompts in tqdm(held_out.items(), desc="acceptance"):
        got = (llm.generate(prompts, sp, use_tqdm=False) if FLAGS.smoke else
               llm.chat([[{"role": "user", "content": p}] for p in prompts], sp, use_tqdm=False))
        acc = {"steps": 0, "tokens": 0, "proposed": 0, "kept": 0}
        for o in got:
            seq = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            if len(o.outputs[0].token_ids) < 2:
                continue
            r = replay(head, cfg, embedding, features_of(params, cfg, seq), seq,
                       len(o.prompt_token_ids), FLAGS.k,
                       lambda hp, e, f, t, nr: draft_fn(hp, embedding=e, features=f,
                                                        next_tokens=t, num_real=nr))
            for key in acc:
                acc[key] += r[key]
        per_kind[kind] = {**acc, "tokens_per_step": acc["tokens"] / max(acc["steps"], 1),
                          "acceptance": acc["kept"] / max(acc["proposed"], 1)}

    os.makedirs(FLAGS.out_dir, exist_ok=True)
    flat = eagle.flatten_head(head)
    head_path = os.path.join(FLAGS.out_dir, "eagle_head.safetensors")
    write_safetensors(head_path, flat, {"target": cfg.name, "window": str(w)})
    n_params = sum(int(v.size) for v in flat.values())
    table = markdown_table(
        ["prompts", f"tokens per verify step (k = {FLAGS.k})", "drafts kept", "output tokens"],
        [[kind, f"{r['tokens_per_step']:.2f}", pct(r["acceptance"]), r["tokens"]]
         for kind, r in per_kind.items()])
    last = curve[-1]
    notes = (f"Target {cfg.name}; head: fc + one layer of the target's shape, {n_params / 1e6:.2f}M "
             f"parameters, window {w}. Trained {steps} steps of {FLAGS.batch} windows on "
             f"{len(train_seqs)} sequences the target generated ({sum(map(len, train_seqs))} tokens, "
             f"greedy, up to {max_tokens} answer tokens; {gen_s:.0f} s) in {train_s:.0f} s; last "
             f"step: loss {last['loss']:.3f}, feature smooth-L1 {last['reg']:.3f}, token "
             f"cross-entropy {last['cls']:.3f}, top-1 agreement with the target {last['top1']:.1%}. "
             "Acceptance replayed along the target's greedy answers to the held-out prompts "
             "(exact for greedy decoding: a draft is kept iff it is the target's next token).")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], label="loss")
    ax.plot([c["step"] for c in curve], [c["reg"] for c in curve], label="feature smooth L1")
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.set_title(f"EAGLE head for {cfg.name}")
    ax.legend()
    fig.tight_layout()
    paths = write_results(
        "train_eagle", FLAGS.out_dir, title=f"An EAGLE head for {cfg.name}",
        command=command_line(), hardware=host_hardware("JAX on the default device"),
        settings={k: getattr(FLAGS, k) for k in ("model", "num_prompts", "max_tokens", "steps",
                                                 "batch", "learning_rate", "cls_rows", "k",
                                                 "seed", "smoke")},
        results={"acceptance": per_kind, "curve": curve, "head_parameters": n_params,
                 "train_tokens": sum(map(len, train_seqs)), "generate_s": gen_s,
                 "train_s": train_s},
        table=table, notes=notes, figure=fig)
    print(table)
    print(notes)
    print("wrote", head_path, ", ".join(paths.values()))


if __name__ == "__main__":
    app.run(main)
