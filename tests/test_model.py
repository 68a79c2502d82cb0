"""The Flax Llama against transformers' LlamaForCausalLM on tiny random checkpoints (fp32).

Paged path: ragged prompts in one StepBatch, randomly permuted block tables, a block size
that does not divide the prompt lengths, padding tokens and a padding sequence; then chunked
prefill and decode steps. Dense path: right-padded batch without and with a KV cache. Both
must give transformers' logits within 1e-4 and its greedy continuations token for token.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hf_fixtures import TINY_CONFIGS, hf_greedy, hf_logits, load_hf_model, make_hf_checkpoint
from quick_subset import first_quick
from paxkv.cache.kv_pool import init_pool
from paxkv.model import dense, params as model_params
from paxkv.model import forward as paged
from paxkv.model.batch import StepBatch
from paxkv.model.weights import load_checkpoint

ATOL = 1e-4
BLOCK_SIZE = 5
PROMPT_LENS = (13, 7, 45, 70, 1)   # > 32 = original_max_position_embeddings of llama3_rope
GREEDY_TOKENS = 32
MAX_LEN = max(PROMPT_LENS) + GREEDY_TOKENS
PREFILL_TOKENS, PREFILL_SEQS = 144, 6   # one padded prefill bucket for every paged test


# The dense KV-cache path shares every layer with the paths tested on all variants; two
# variants (GQA, llama3 RoPE) cover its own code and keep the suite's compile count down.
DENSE_CACHE_CONFIGS = ("gqa", "llama3_rope")
_BUILT: dict[str, tuple] = {}


def _build(name: str, tmp_path_factory) -> tuple:
    if name not in _BUILT:
        path = make_hf_checkpoint(tmp_path_factory.mktemp(name), seed=7, **TINY_CONFIGS[name])
        params, cfg = load_checkpoint(path, dtype="float32")
        hf = load_hf_model(path)
        rng = np.random.default_rng(len(name))
        prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPT_LENS]
        _BUILT[name] = (name, params, cfg, hf, prompts)
    return _BUILT[name]


# mha and the sharded checkpoint add little a contributor needs before pushing: full suite only.
QUICK_CONFIGS = ["gqa", "llama3_rope", "tied"]


@pytest.fixture(scope="module", params=first_quick(
    QUICK_CONFIGS + sorted(set(TINY_CONFIGS) - set(QUICK_CONFIGS)), n=len(QUICK_CONFIGS)))
def setup(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=DENSE_CACHE_CONFIGS)
def dense_setup(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


class PagedSeqs:
    """Host-side bookkeeping for a few sequences over randomly permuted blocks."""

    def __init__(self, num_seqs: int, max_len: int, block_size: int, seed: int):
        self.bs = block_size
        self.blocks_per_seq = math.ceil(max_len / block_size)
        self.num_blocks = 1 + num_seqs * self.blocks_per_seq
        perm = np.random.default_rng(seed).permutation(np.arange(1, self.num_blocks))
        self.tables = perm.reshape(num_seqs, self.blocks_per_seq)
        self.cached = [0] * num_seqs

    def batch(self, new_tokens: list[list[int]], num_tokens: int | None = None,
              num_seqs: int | None = None) -> StepBatch:
        """StepBatch appending `new_tokens[i]` to sequence i (empty lists: sequence idle),
        padded to `num_tokens` tokens and `num_seqs` rows as the runner's buckets are
        (default: 3 padding tokens and 1 padding sequence)."""
        tokens, positions, slots, cu, rows, ctx = [], [], [], [0], [], []
        for i, new in enumerate(new_tokens):
            if not new:
                continue
            for j, t in enumerate(new):
                p = self.cached[i] + j
                tokens.append(t)
                positions.append(p)
                slots.append(int(self.tables[i, p // self.bs]) * self.bs + p % self.bs)
            self.cached[i] += len(new)
            cu.append(len(tokens))
            rows.append(self.tables[i])
            ctx.append(self.cached[i])
        logits_indices = [c - 1 for c in cu[1:]]
        pad_tokens = 3 if num_tokens is None else num_tokens - len(tokens)
        pad_seqs = 1 if num_seqs is None else num_seqs - len(rows)
        assert pad_tokens >= 0 and pad_seqs >= 0
        for j in range(pad_tokens):  # padding tokens write into the null block 0
            tokens.append(0)
            positions.append(0)
            slots.append(j % self.bs)
        for _ in range(pad_seqs):
            cu.append(cu[-1])
            rows.append(np.zeros(self.blocks_per_seq, np.int64))
            ctx.append(0)
            logits_indices.append(0)
        i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)
        return StepBatch(token_ids=i32(tokens), positions=i32(positions), slot_mapping=i32(slots),
                         block_tables=i32(np.stack(rows)), context_lens=i32(ctx),
                         cu_q_lens=i32(cu), logits_indices=i32(logits_indices))


def test_paged_prefill_logits_match_transformers(setup):
    name, params, cfg, hf, prompts = setup
    seqs = PagedSeqs(len(prompts), MAX_LEN, BLOCK_SIZE, seed=1)
    pool = init_pool(cfg, seqs.num_blocks, BLOCK_SIZE, jnp.float32)
    batch = seqs.batch(prompts, PREFILL_TOKENS, PREFILL_SEQS)
    last, _ = paged.forward_jit(params, batch, pool, cfg)
    assert last.shape == (PREFILL_SEQS, cfg.vocab_size) and last.dtype == jnp.float32
    pool = init_pool(cfg, seqs.num_blocks, BLOCK_SIZE, jnp.float32)
    every, _ = paged.forward_jit(params, batch, pool, cfg, all_logits=True)
    assert every.shape == (PREFILL_TOKENS, cfg.vocab_size)
    start = 0
    for i, prompt in enumerate(prompts):
        ref = hf_logits(hf, prompt)
        np.testing.assert_allclose(np.asarray(every[start:start + len(prompt)]), ref, atol=ATOL, rtol=0)
        np.testing.assert_allclose(np.asarray(last[i]), ref[-1], atol=ATOL, rtol=0)
        start += len(prompt)


def test_paged_chunked_prefill_then_decode_matches_transformers_greedy(setup):
    """Prefill in two chunks per prompt, then decode all sequences together, greedily."""
    name, params, cfg, hf, prompts = setup
    prompts = prompts[:4]  # the length-1 prompt cannot be chunked
    seqs = PagedSeqs(len(PROMPT_LENS), MAX_LEN, BLOCK_SIZE, seed=2)
    pool = init_pool(cfg, seqs.num_blocks, BLOCK_SIZE, jnp.float32)
    cut = [len(p) // 2 + 1 for p in prompts]
    # Step 1: first chunks of sequences 0 and 2 only; step 2: the rest of everything.
    # Both padded to the prefill bucket of the test above, as the engine's runner pads:
    # one compilation for both steps.
    step1 = [p[:c] if i % 2 == 0 else [] for i, (p, c) in enumerate(zip(prompts, cut))]
    step2 = [p[c:] if i % 2 == 0 else p for i, (p, c) in enumerate(zip(prompts, cut))]
    _, pool = paged.forward_jit(params, seqs.batch(step1, PREFILL_TOKENS, PREFILL_SEQS), pool, cfg)
    logits, pool = paged.forward_jit(params, seqs.batch(step2, PREFILL_TOKENS, PREFILL_SEQS), pool, cfg)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(logits[i]), hf_logits(hf, p)[-1], atol=ATOL, rtol=0)
    generated = [[int(t)] for t in np.argmax(np.asarray(logits[:len(prompts)]), axis=-1)]
    for _ in range(GREEDY_TOKENS - 1):
        batch = seqs.batch([[g[-1]] for g in generated], num_tokens=5, num_seqs=5)
        logits, pool = paged.forward_jit(params, batch, pool, cfg, decode_only=True)
        for g, t in zip(generated, np.argmax(np.asarray(logits[:len(prompts)]), axis=-1)):
            g.append(int(t))
    for p, g in zip(prompts, generated):
        assert g == hf_greedy(hf, p, GREEDY_TOKENS)


def test_dense_forward_without_cache_matches_transformers(setup):
    name, params, cfg, hf, prompts = setup
    t = max(PROMPT_LENS)
    ids = np.zeros((len(prompts), t), np.int32)  # right padding: must not affect real tokens
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    logits, cache = jax.jit(dense.dense_forward, static_argnames="cfg")(params, jnp.asarray(ids), cfg)
    assert cache is None and logits.shape == (len(prompts), t, cfg.vocab_size)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(logits[i, :len(p)]), hf_logits(hf, p), atol=ATOL, rtol=0)


def test_dense_forward_with_cache_ragged_decode(dense_setup):
    """Prefill a right-padded batch, then decode with per-row start positions."""
    name, params, cfg, hf, prompts = dense_setup
    lens = np.array([len(p) for p in prompts])
    ids = np.zeros((len(prompts), lens.max()), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    cache = dense.init_cache(cfg, len(prompts), int(lens.max()) + 8, jnp.float32)
    logits, cache = dense.dense_forward_jit(params, jnp.asarray(ids), cfg, cache, 0)
    rng = np.random.default_rng(3)
    seqs = [list(p) for p in prompts]
    for step in range(3):
        new = rng.integers(0, cfg.vocab_size, len(prompts))
        for s, t in zip(seqs, new):
            s.append(int(t))
        logits, cache = dense.dense_forward_jit(params, jnp.asarray(new[:, None], jnp.int32), cfg,
                                                cache, jnp.asarray(lens + step, jnp.int32))
        for i, s in enumerate(seqs):
            np.testing.assert_allclose(np.asarray(logits[i, 0]), hf_logits(hf, s)[-1], atol=ATOL, rtol=0)


def test_dense_greedy_generate_matches_transformers(dense_setup):
    name, params, cfg, hf, prompts = dense_setup
    # Prompts of one length bucket (one prefill + one decode compilation); 13 + 32 tokens
    # still run past llama3_rope's original_max_position_embeddings of 32.
    for p in (prompts[0], prompts[1], prompts[4]):
        assert dense.greedy_generate(params, cfg, p, GREEDY_TOKENS) == hf_greedy(hf, p, GREEDY_TOKENS)


def test_greedy_generate_stops_and_rejects_bad_input(tmp_path_factory):
    name, params, cfg, hf, prompts = _build("gqa", tmp_path_factory)
    full = dense.greedy_generate(params, cfg, prompts[0], GREEDY_TOKENS)
    stop = full[5]
    assert dense.greedy_generate(params, cfg, prompts[0], GREEDY_TOKENS, stop_token_ids=[stop]) == \
        full[:full.index(stop) + 1]
    with pytest.raises(ValueError, match="prompt_ids"):
        dense.greedy_generate(params, cfg, [], 4)
    with pytest.raises(ValueError, match="prompt_ids"):
        dense.greedy_generate(params, cfg, [cfg.vocab_size], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dense.greedy_generate(params, cfg, [1], -1)


def test_forward_rejects_mismatched_pool(setup):
    name, params, cfg, hf, prompts = setup
    seqs = PagedSeqs(1, 8, BLOCK_SIZE, seed=0)
    batch = seqs.batch([prompts[0][:4]])
    bad = init_pool(cfg, seqs.num_blocks, BLOCK_SIZE, jnp.float32)
    bad = bad._replace(k=bad.k[:1], v=bad.v[:1])
    with pytest.raises(ValueError, match="layer slots"):
        paged.forward(params, batch, bad, cfg)


def test_bfloat16_weights_track_float32(tmp_path):
    """bf16 weights (fp32 norms/softmax): same shapes, logits close to fp32, paged == dense."""
    path = make_hf_checkpoint(tmp_path, seed=3, **TINY_CONFIGS["gqa"])
    p32, cfg = load_checkpoint(path, dtype="float32")
    p16, _ = load_checkpoint(path, dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(p16))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 21).tolist()
    dense_jit = jax.jit(dense.dense_forward, static_argnames="cfg")
    ref = np.asarray(dense_jit(p32, jnp.asarray([prompt]), cfg)[0][0])
    dense16 = np.asarray(dense_jit(p16, jnp.asarray([prompt]), cfg)[0][0])
    assert dense16.dtype == np.float32
    spread = ref.std()
    assert np.abs(dense16 - ref).max() < 0.1 * spread   # bf16 rounding, not a different model
    seqs = PagedSeqs(1, len(prompt), BLOCK_SIZE, seed=4)
    pool = init_pool(cfg, seqs.num_blocks, BLOCK_SIZE, jnp.bfloat16)
    batch = seqs.batch([prompt], num_tokens=len(prompt), num_seqs=1)
    paged16, pool = jax.jit(paged.forward_all_logits, static_argnames="cfg")(p16, batch, pool, cfg)
    assert pool.k[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(paged16), dense16, atol=0.05 * spread, rtol=0)


@pytest.mark.slow
def test_init_params_shapes_and_training_step():
    """init_params matches the checkpoint layout and the no-cache path trains (loss drops)."""
    from paxkv.config import ModelConfig
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    params = model_params.init_params(cfg, jax.random.key(0), jnp.float32)
    shapes = model_params.param_shapes(cfg, jnp.float32)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(shapes)
    assert "lm_head" not in params
    np.testing.assert_array_equal(np.asarray(params["norm"]["scale"]), 1.0)
    emb = np.asarray(params["embed_tokens"]["embedding"])
    assert 0.015 < emb.std() < 0.025
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 16)), jnp.int32)

    def loss_fn(p):
        logits, _ = dense.dense_forward(p, tokens[:, :-1], cfg)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    losses = []
    for _ in range(20):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0]
