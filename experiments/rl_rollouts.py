"""GRPO with optax, paxkv generating the rollouts in the trainer's own process.

Each step: `LLM.generate` samples `--group` completions for each of `--prompts_per_step`
prompts (Austen openings); a verifiable reward scores them (1 if the completion contains
`--keyword`, else 0); advantages are the rewards minus their group's mean, over the group's
standard deviation; the policy-gradient loss is the advantage-weighted mean log-probability
of each completion's tokens (`paxkv.model.dense.token_logprobs`, the trainer's side); one
optax step; `LLM.update_weights` hands the new weights to the engine (its own tree: the
arrays are taken without a copy where the layout allows). On-policy, one update per batch, so
the importance ratio is one and no clipping is needed; the gap between the engine's logprob
of each sampled token and the trainer's is measured every step (the mismatch RL frameworks
correct for).

    PYTHONPATH=. python3 experiments/rl_rollouts.py                     # CPU: a few minutes
    PYTHONPATH=. python3 experiments/rl_rollouts.py --out_dir=results   # update the results

Writes rl_rollouts.{json,md,png}: the reward curve, the update's time against a fresh
engine's, rollout tokens per second, and the logprob gap.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
from absl import app, flags
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "checkpoint dir, GGUF file or 'tiny' (the embedded model)")
flags.DEFINE_integer("steps", 30, "GRPO steps")
flags.DEFINE_integer("prompts_per_step", 8, "prompts per step")
flags.DEFINE_integer("group", 8, "completions per prompt (the group the advantage is taken in)")
flags.DEFINE_integer("max_tokens", 24, "tokens per completion at most")
flags.DEFINE_float("temperature", 1.0, "sampling temperature of the rollouts")
flags.DEFINE_float("learning_rate", 3e-4, "Adam's learning rate")
flags.DEFINE_string("keyword", "Mrs.", "the reward: 1 when the completion contains it")
flags.DEFINE_integer("seed", 0, "seed of the rollouts")
flags.DEFINE_bool("batch_invariant", False, "LLM(batch_invariant=True), and the trainer on "
                  "the engine's config: the engine's logprobs equal the trainer's bitwise")
flags.DEFINE_string("out_dir", "scratch/results", "where rl_rollouts.json/.md/.png go "
                    "(--out_dir=results updates the committed results)")

PROMPTS = ["It was a fine morning, and", "She said that", "The next day", "\"My dear,\" said",
           "In the evening", "Her sister", "When they arrived", "He had not been long",
           "After dinner", "The letter", "Elizabeth could not", "Their visit"]


def main(argv: list[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    import optax

    from paxkv import LLM, SamplingParams
    from paxkv.builder import resolve_model
    from paxkv.model.dense import token_logprobs
    from paxkv.model.fusion import fuse_projections
    from paxkv.model.weights import load_checkpoint

    path, _ = resolve_model(FLAGS.model)
    params, cfg = load_checkpoint(path, dtype="float32")
    t0 = time.perf_counter()
    llm = LLM(FLAGS.model, dtype="float32", seed=FLAGS.seed, max_num_seqs=max(
        64, FLAGS.prompts_per_step * FLAGS.group), batch_invariant=FLAGS.batch_invariant)
    fresh_s = time.perf_counter() - t0
    cfg = llm.model_config      # computes as the engine does (batch-invariant when asked)
    tok = llm.get_tokenizer()
    optimizer = optax.adam(FLAGS.learning_rate)
    opt_state = optimizer.init(params)

    def loss_fn(p, tokens, mask, advantages):
        lp = token_logprobs(p, tokens, cfg)                  # [N, T - 1]
        per_seq = jnp.sum(lp * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)
        return -jnp.mean(advantages * per_seq)

    @jax.jit
    def train_step(p, state, tokens, mask, advantages):
        loss, grads = jax.value_and_grad(loss_fn)(p, tokens, mask, advantages)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    trainer_lp = jax.jit(lambda p, t: token_logprobs(p, t, cfg))
    rng = np.random.default_rng(FLAGS.seed)
    history = []
    for step in tqdm(range(FLAGS.steps), desc="GRPO steps"):
        prompts = [PROMPTS[i] for i in rng.choice(len(PROMPTS), FLAGS.prompts_per_step, replace=False)]
        sp = SamplingParams(n=FLAGS.group, temperature=FLAGS.temperature, max_tokens=FLAGS.max_tokens,
                            seed=int(rng.integers(2**31 - 1)), logprobs=0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        gen_s = time.perf_counter() - t0
        seqs, rewards, engine_lps, prompt_lens = [], [], [], []
        for out in outs:
            for c in out.outputs:
                seqs.append(list(out.prompt_token_ids) + list(c.token_ids))
                prompt_lens.append(len(out.prompt_token_ids))
                rewards.append(float(FLAGS.keyword in c.text))
                engine_lps.append([entry[t] for t, entry in zip(c.token_ids, c.logprobs)])
        r = np.asarray(rewards).reshape(len(prompts), FLAGS.group)
        adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)
        width = max(map(len, seqs))
        tokens = np.zeros((len(seqs), width), np.int32)
        mask = np.zeros((len(seqs), width - 1), np.float32)
        for i, (s, n) in enumerate(zip(seqs, prompt_lens)):
            tokens[i, :len(s)] = s
            mask[i, n - 1:len(s) - 1] = 1.0          # the completion's tokens
        ours = np.asarray(trainer_lp(params, jnp.asarray(tokens)))
        gap = max(abs(ours[i, prompt_lens[i] - 1 + j] - lp)
                  for i, lps in enumerate(engine_lps) for j, lp in enumerate(lps))
        t0 = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(tokens),
                                             jnp.asarray(mask), jnp.asarray(adv, jnp.float32))
        jax.block_until_ready(params)
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.update_weights(fuse_projections(params))
        jax.block_until_ready(llm.llm_engine.runner.params)
        update_s = time.perf_counter() - t0
        gen_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        history.append({"step": step, "reward": float(r.mean()), "loss": float(loss),
                        "rollout_s": gen_s, "rollout_tokens": gen_tokens,
                        "rollout_tokens_per_s": gen_tokens / gen_s, "train_s": train_s,
                        "update_s": update_s, "logprob_gap_max": float(gap)})
    first, last = history[: max(1, len(history) // 5)], history[-max(1, len(history) // 5):]
    summary = {
        "reward_first_fifth": float(np.mean([h["reward"] for h in first])),
        "reward_last_fifth": float(np.mean([h["reward"] for h in last])),
        "update_s_median": float(np.median([h["update_s"] for h in history[1:] or history])),
        "fresh_engine_s": fresh_s,
        "rollout_tokens_per_s_median": float(np.median([h["rollout_tokens_per_s"] for h in history[1:] or history])),
        "logprob_gap_max": float(max(h["logprob_gap_max"] for h in history)),
        "tokenizer": tok is not None,
    }
    table = common.markdown_table(
        ["what", "value"],
        [["mean reward, first fifth of the steps", f"{summary['reward_first_fifth']:.3f}"],
         ["mean reward, last fifth of the steps", f"{summary['reward_last_fifth']:.3f}"],
         ["update_weights (median)", f"{summary['update_s_median'] * 1e3:.1f} ms"],
         ["a fresh LLM(...) instead", f"{summary['fresh_engine_s']:.1f} s"],
         ["rollout tokens/s (median)", f"{summary['rollout_tokens_per_s_median']:.0f}"],
         ["largest |engine - trainer| logprob of a sampled token", f"{summary['logprob_gap_max']:.2e}"]])
    notes = (f"{FLAGS.steps} steps of {FLAGS.prompts_per_step} prompts x {FLAGS.group} completions "
             f"of up to {FLAGS.max_tokens} tokens at temperature {FLAGS.temperature}; reward: the "
             f"completion contains {FLAGS.keyword!r}; Adam, learning rate {FLAGS.learning_rate}. The "
             "logprob gap compares the engine's logprob of each sampled token with the trainer's "
             "(`token_logprobs`, the dense forward) on the same weights, float32 on both sides: "
             + ("with `batch_invariant` both compute each token the same way, so it is zero."
                if FLAGS.batch_invariant else "the batch-dependent rounding of the paged forward "
                "(`--batch_invariant` removes it)."))
    paths = common.write_results(
        "rl_rollouts_batch_invariant" if FLAGS.batch_invariant else "rl_rollouts", FLAGS.out_dir,
        title="GRPO rollouts through paxkv, weights synced in place",
        command=common.command_line(), hardware=common.host_hardware("JAX on the default device"),
        settings={k: FLAGS[k].value for k in ("model", "steps", "prompts_per_step", "group",
                                               "max_tokens", "temperature", "learning_rate",
                                               "keyword", "seed", "batch_invariant")},
        results={"summary": summary, "history": history}, table=table, notes=notes,
        figure=_figure(history))
    print(table)
    print("wrote", ", ".join(paths.values()))


def _figure(history: list[dict]):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    steps = [h["step"] for h in history]
    ax[0].plot(steps, [h["reward"] for h in history], "o-")
    ax[0].set_xlabel("GRPO step")
    ax[0].set_ylabel("mean reward")
    ax[0].set_title(f"reward: completion contains {FLAGS.keyword!r}")
    ax[1].plot(steps, [h["update_s"] * 1e3 for h in history], "o-", label="update_weights")
    ax[1].set_xlabel("GRPO step")
    ax[1].set_ylabel("ms")
    ax[1].set_title("weight sync per step")
    ax[1].legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    app.run(main)
