"""The EAGLE draft head (`paxkv/spec_decode/eagle.py`): the features it reads are what the
target's LM head reads, padding in its window is invisible, and its loss trains."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from paxkv.config import PRESETS
from paxkv.model.dense import dense_forward
from paxkv.model.weights import random_params
from paxkv.spec_decode import eagle

CFG = dataclasses.replace(PRESETS["tiny-random"], tie_word_embeddings=True)


def _embedding(seed: int = 1) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (CFG.vocab_size, CFG.hidden_size)) * 0.05


def test_features_are_what_the_lm_head_reads():
    params = random_params(CFG, jax.random.PRNGKey(0), jnp.float32)
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, 13), 3, CFG.vocab_size)
    logits, _, hidden = dense_forward(params, ids, CFG, hidden_layers=(CFG.num_layers,))
    embedding = params["embed_tokens"]["embedding"]
    np.testing.assert_allclose(np.asarray(eagle.head_logits(hidden[:, 0], embedding)),
                               np.asarray(logits[0]), rtol=1e-4, atol=1e-4)


def test_window_padding_is_invisible():
    """The same 5 real rows right-aligned in the window, behind two different paddings:
    the same drafts."""
    head = eagle.init_head(CFG, jax.random.PRNGKey(0))
    e = _embedding()
    w, n = eagle.WINDOW, 5
    rng = np.random.default_rng(0)
    real_f = rng.normal(size=(n, CFG.hidden_size)).astype(np.float32)
    real_t = rng.integers(3, CFG.vocab_size, n).astype(np.int32)
    outs = []
    for seed in (1, 2):
        pad = np.random.default_rng(seed)
        f = pad.normal(size=(w, CFG.hidden_size)).astype(np.float32)
        t = pad.integers(3, CFG.vocab_size, w).astype(np.int32)
        f[w - n:], t[w - n:] = real_f, real_t
        outs.append(np.asarray(eagle.draft(head, CFG, e, f, t, n, 3)))
    assert outs[0].tolist() == outs[1].tolist()
    # while the real rows do reach the prediction
    head_fn = eagle.EagleHead(eagle.head_config(CFG))
    pos = jnp.asarray(np.r_[np.full(w - n, eagle.PAD_POSITION), np.arange(n)], jnp.int32)[None]
    a = head_fn.apply({"params": head}, f[None], t[None], e, pos)[0, -1]
    f[w - n] += 1.0
    b = head_fn.apply({"params": head}, f[None], t[None], e, pos)[0, -1]
    assert float(jnp.abs(a - b).max()) > 1e-4


def test_loss_trains_on_a_fixed_batch():
    e = _embedding()
    rng = np.random.default_rng(0)
    b, t = 4, 24
    feats = jnp.asarray(rng.normal(size=(b, t, CFG.hidden_size)).astype(np.float32))
    toks = jnp.asarray(rng.integers(3, CFG.vocab_size, (b, t)), jnp.int32)
    mask = jnp.ones((b, t)).at[0, 20:].set(0.0)
    rows = jnp.tile(jnp.arange(8, dtype=jnp.int32)[None], (b, 1))
    head = eagle.init_head(CFG, jax.random.PRNGKey(0))
    opt = optax.adam(3e-3)
    state = opt.init(head)

    @jax.jit
    def step(head, state):
        (loss, _), g = jax.value_and_grad(eagle.eagle_loss, has_aux=True)(
            head, CFG, e, feats, toks, mask, rows)
        updates, state = opt.update(g, state, head)
        return optax.apply_updates(head, updates), state, loss

    losses = []
    for _ in range(40):
        head, state, loss = step(head, state)
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0], losses[::10]
