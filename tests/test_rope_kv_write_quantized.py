"""RoPE + quantizing KV-page write for 8-bit pools (`rope_kv_write_quantized`) against the jnp
path it replaces (`_rotate`, `quant.quantize`, `kv_pool.write_layer_quantized`), on fresh random
inputs: codes and scales bit for bit, slots mid-block, padding slots, an all-zero row, int8's
ties, the untouched slots; that it lowers through Pallas' Triton backend; and one model step
with the fused plan on an 8-bit pool, through the kernel and through the jnp path."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import layer_ops
from pallas_kernels.layer_ops import (rope_kv_write, rope_kv_write_quantized,
                                      rope_kv_write_quantized_reference)
from paxkv.cache import kv_pool as kvp
from paxkv.cache import quant
from paxkv.config import AttentionPlan, ModelConfig
from paxkv.model.batch import StepBatch
from quick_subset import first_quick

NAMES = ("fp8", "fp8_e5m2", "int8")
# (relative bound, absolute bound in units of the row's scale) of one code's rounding error
ROUNDING = {jnp.dtype(jnp.float8_e4m3fn): (2.0 ** -4, 2.0 ** -10),
            jnp.dtype(jnp.float8_e5m2): (2.0 ** -3, 2.0 ** -17), jnp.dtype(jnp.int8): (0.0, 0.5)}
# the jnp path as the engine runs it: jitted (XLA contracts the rotation's multiply-adds
# there, in the kernel's interpreted body as in the reference)
reference = jax.jit(rope_kv_write_quantized_reference)


def bits(x) -> np.ndarray:
    """The raw bit patterns of an array (bitwise comparison of float codes and scales)."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_case(seed: int, name: str, *, q_heads: int, kv_heads: int, head_dim: int,
              dtype=jnp.bfloat16, tokens: int = 9, num_blocks: int = 6, block_size: int = 4,
              identity: bool = False):
    """(args of the kernel, the slots the jnp path should be given): permuted slots (so some
    blocks end part-filled), one -1 padding slot and one past the pool, one token whose k and v
    heads are all zero; old pages and scales random."""
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((tokens, q_heads + 2 * kv_heads, head_dim)) * 3.0
    qkv *= 10.0 ** rng.uniform(-2, 2, (tokens, q_heads + 2 * kv_heads, 1))   # rows of all scales
    qkv[4, q_heads:] = 0.0
    qkv = jnp.asarray(qkv, dtype)
    angles = rng.uniform(0, 300, (tokens, head_dim // 2)).astype(np.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if identity:   # no rotation: k as it came, exact on every device
        cos, sin = jnp.ones_like(cos), jnp.zeros_like(sin)
    num_slots = num_blocks * block_size
    slots = rng.permutation(num_slots)[:tokens].astype(np.int32)
    slots[2] = -1
    slots[6] = num_slots + 3
    storage = quant.storage_dtype(name)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_pages = jnp.asarray(rng.standard_normal(shape) * 50, jnp.float32).astype(storage)
    v_pages = jnp.asarray(rng.standard_normal(shape) * 50, jnp.float32).astype(storage)
    k_scale = jnp.asarray(rng.uniform(0.1, 1, shape[:3]), quant.SCALE_DTYPE)
    v_scale = jnp.asarray(rng.uniform(0.1, 1, shape[:3]), quant.SCALE_DTYPE)
    args = (qkv, cos, sin, jnp.asarray(slots), k_pages, v_pages, k_scale, v_scale)
    dropped = np.where(slots < 0, num_slots + 1, slots)   # jnp's scatter drops these too
    return args, jnp.asarray(dropped)


def assert_equal_writes(got, want, *, exact_k: bool):
    """q, codes and scales as the jnp path has them; k's only to rounding where `exact_k` is
    False (a GPU's fused multiply-adds in the rotation, which one k row's scale follows)."""
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
    q, k, v, ks, vs = got
    wq, wk, wv, wks, wvs = want
    np.testing.assert_array_equal(bits(v), bits(wv))
    np.testing.assert_array_equal(bits(vs), bits(wvs))
    if exact_k:
        np.testing.assert_array_equal(bits(q), bits(wq))
        np.testing.assert_array_equal(bits(k), bits(wk))
        np.testing.assert_array_equal(bits(ks), bits(wks))
        return
    def f32(x):
        return np.asarray(jnp.asarray(x, jnp.float32))

    np.testing.assert_allclose(f32(q), f32(wq), rtol=8e-3, atol=8e-3)
    np.testing.assert_allclose(f32(ks), f32(wks), rtol=1e-2)
    # each side within one code's rounding of (nearly) the same rotated value
    rel, units = ROUNDING[jnp.dtype(k.dtype)]
    deq, wdeq = f32(quant.dequantize(k, ks)), f32(quant.dequantize(wk, wks))
    scale = np.maximum(f32(ks), f32(wks))[..., None]
    bound = (2 * rel + 2 ** -7) * np.abs(wdeq) * 1.01 + 2 * units * scale + 1e-30
    assert np.all(np.abs(deq - wdeq) <= bound)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim",
                         first_quick([(8, 2, 32), (4, 4, 16), (8, 1, 64), (16, 4, 128)]))
def test_kernel_writes_what_the_jnp_path_writes(name, dtype, q_heads, kv_heads, head_dim,
                                                interpret):
    args, dropped = make_case(q_heads * head_dim + kv_heads, name, q_heads=q_heads,
                              kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    got = rope_kv_write_quantized(*args, interpret=interpret)
    want = reference(*args[:3], dropped, *args[4:])
    assert_equal_writes(got, want, exact_k=interpret)
    # the untouched slots kept their old codes and scales, the written ones hold the new
    slots = np.asarray(args[3])
    num_slots = args[4].shape[0] * args[4].shape[1]
    written = [s for s in slots if 0 <= s < num_slots]
    untouched = sorted(set(range(num_slots)) - set(written))
    for new, old in zip(got[1:], args[4:]):
        flat_new, flat_old = bits(new).reshape(num_slots, -1), bits(old).reshape(num_slots, -1)
        np.testing.assert_array_equal(flat_new[untouched], flat_old[untouched])
        assert not np.array_equal(flat_new[written], flat_old[written])
    # the all-zero token (slot of token 4): scale 0, codes 0 (-0 where the rotation gave -0)
    zero_slot = slots[4]
    for codes, scale in ((got[1], got[3]), (got[2], got[4])):
        assert np.all(np.asarray(codes, np.float32).reshape(num_slots, -1)[zero_slot] == 0)
        assert np.all(np.asarray(scale, np.float32).reshape(num_slots, -1)[zero_slot] == 0)


@pytest.mark.parametrize("name", NAMES)
def test_codes_and_scales_are_exact_without_rotation(name, interpret):
    """With cos 1 and sin 0 the rotation is exact on any device, so the quantization of k and
    v must match bit for bit compiled too (the GPU's division and rounding included)."""
    args, dropped = make_case(11, name, q_heads=8, kv_heads=2, head_dim=64, tokens=24,
                              num_blocks=8, identity=True)
    got = rope_kv_write_quantized(*args, interpret=interpret)
    assert_equal_writes(got, reference(*args[:3], dropped, *args[4:]), exact_k=True)


def test_int8_rounds_half_to_even(interpret):
    """Codes that land on .5 (scale 1: the row's largest value is 127) round to even."""
    row = np.zeros(16, np.float32)
    row[:9] = [127.0, -2.5, 3.5, 0.5, -0.5, 1.5, -126.5, 125.5, 2.25]
    qkv = np.tile(row, (1, 4, 1))                      # one token, q, k and v heads alike
    qkv = jnp.asarray(qkv, jnp.float32)
    ones, zeros = jnp.ones((1, 8), jnp.float32), jnp.zeros((1, 8), jnp.float32)
    pages = jnp.zeros((1, 4, 1, 16), jnp.int8)
    scales = jnp.zeros((1, 4, 1), quant.SCALE_DTYPE)
    slot = jnp.asarray([1], jnp.int32)
    args = (qkv, ones, zeros, slot, pages, pages, scales, scales)
    got = rope_kv_write_quantized(*args, interpret=interpret)
    assert_equal_writes(got, reference(*args), exact_k=True)
    expect = [127, -2, 4, 0, 0, 2, -126, 126, 2]
    for codes, scale in ((got[1], got[3]), (got[2], got[4])):
        assert float(scale[0, 1, 0]) == 1.0
        assert np.asarray(codes)[0, 1, 0, :9].tolist() == expect


def test_kernel_refuses_what_it_cannot_write(interpret):
    args, _ = make_case(0, "fp8", q_heads=4, kv_heads=2, head_dim=16)
    qkv, cos, sin, slots, kp, vp, ks, vs = args
    plain = kp.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="8-bit"):
        rope_kv_write_quantized(qkv, cos, sin, slots, plain, plain, ks, vs, interpret=interpret)
    with pytest.raises(ValueError, match="k_scale"):
        rope_kv_write_quantized(qkv, cos, sin, slots, kp, vp, ks[:, :, :1], vs,
                                interpret=interpret)
    with pytest.raises(ValueError, match="powers of two"):
        rope_kv_write_quantized(qkv[:, 1:], cos, sin, slots, kp, vp, ks, vs, interpret=interpret)
    with pytest.raises(ValueError, match="num_warps"):
        rope_kv_write_quantized(*args, interpret=interpret, num_warps=3)


@pytest.mark.parametrize("name", NAMES)
def test_kernel_lowers_through_triton(name):
    """The kernel's every operation has a Pallas Triton lowering rule: lowered for CUDA (no GPU
    needed: the Triton IR is built at lowering). Skips where this JAX cannot lower for CUDA at
    all, as `rope_kv_write` shows."""
    t, hq, hkv, d = 4, 8, 2, 32
    sds = jax.ShapeDtypeStruct
    plain = (sds((t, hq + 2 * hkv, d), jnp.bfloat16), sds((t, d // 2), jnp.float32),
             sds((t, d // 2), jnp.float32), sds((t,), jnp.int32))
    try:
        jax.jit(functools.partial(rope_kv_write, interpret=False)).trace(
            *plain, sds((4, 4, hkv, d), jnp.bfloat16), sds((4, 4, hkv, d), jnp.bfloat16)
        ).lower(lowering_platforms=("cuda",))
    except Exception as e:   # noqa: BLE001 - whatever keeps the known-good kernel from lowering
        pytest.skip(f"this JAX does not lower Pallas Triton kernels for CUDA here: {e!r:.200}")
    pages = sds((4, 4, hkv, d), quant.storage_dtype(name))
    scales = sds((4, 4, hkv), quant.SCALE_DTYPE)
    lowered = jax.jit(functools.partial(rope_kv_write_quantized, interpret=False)).trace(
        *plain, pages, pages, scales, scales).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "triton" in text and "paxkv_rope_kv_write_quantized" in text


CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=256,
                  name="rkvq-test")


def run_steps(params, name: str, plan: AttentionPlan):
    """A prefill chunk of two sequences, then a decode step, on a fresh 8-bit pool -> (the two
    steps' logits, the pool)."""
    from paxkv.model.forward import forward
    bs, lens = 8, (13, 6)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, CFG.vocab_size, sum(lens) + 2)
    tables = np.asarray([[3, 1, 0], [2, 4, 0]], np.int32)
    pool = kvp.init_pool(CFG, 6, bs, jnp.float32, kv_cache_dtype=name)
    pos = np.concatenate([np.arange(n) for n in lens])
    seq = np.repeat([0, 1], lens)
    pre = StepBatch(jnp.asarray(ids[:sum(lens)], jnp.int32), jnp.asarray(pos, jnp.int32),
                    jnp.asarray(tables[seq, pos // bs] * bs + pos % bs, jnp.int32),
                    jnp.asarray(tables), jnp.asarray(lens, jnp.int32),
                    jnp.asarray([0, lens[0], sum(lens)], jnp.int32),
                    jnp.asarray([lens[0] - 1, sum(lens) - 1], jnp.int32))
    dpos = np.asarray(lens)
    dec = StepBatch(jnp.asarray(ids[-2:], jnp.int32), jnp.asarray(dpos, jnp.int32),
                    jnp.asarray(tables[[0, 1], dpos // bs] * bs + dpos % bs, jnp.int32),
                    jnp.asarray(tables), jnp.asarray(dpos + 1, jnp.int32),
                    jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray([0, 1], jnp.int32))
    logits = []
    for batch, decode_only in ((pre, False), (dec, True)):
        # a fresh jit per run: a run with the kernel swapped out must trace anew
        step = jax.jit(lambda b, p, d=decode_only: forward(params, b, p, CFG, plan=plan,
                                                            decode_only=d))
        out, pool = step(batch, pool)
        logits.append(np.asarray(out))
    return logits, pool


@pytest.mark.parametrize("name", first_quick(list(NAMES)))
def test_fused_plan_on_8bit_pool_writes_through_the_kernel(name, monkeypatch):
    """One model step (prefill, then decode) with the fused plan on an 8-bit pool goes through
    `rope_kv_write_quantized` and leaves the pool as the jnp path does in its place (bit for
    bit interpreted; compiled, to the rotation's rounding); the logits match the reference
    backend's."""
    from paxkv.model.fusion import fuse_projections
    from paxkv.model.weights import random_params
    params = fuse_projections(random_params(CFG, 0, jnp.float32))
    plan = AttentionPlan("pallas", fused=True)
    calls = []
    kernel = layer_ops.rope_kv_write_quantized

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return kernel(*a, **kw)

    monkeypatch.setattr(layer_ops, "rope_kv_write_quantized", spy)
    got_logits, got_pool = run_steps(params, name, plan)
    assert len(calls) == 2   # the prefill step and the decode step, one layer each

    def jnp_path(*a, interpret, num_warps=None):
        del interpret, num_warps
        return rope_kv_write_quantized_reference(*a)

    monkeypatch.setattr(layer_ops, "rope_kv_write_quantized", jnp_path)
    want_logits, want_pool = run_steps(params, name, plan)
    if jax.default_backend() != "gpu":
        for g, w in zip(jax.tree.leaves(got_pool), jax.tree.leaves(want_pool)):
            np.testing.assert_array_equal(bits(g), bits(w))
        # The pool (the kernel's output) is bit for bit the jnp path's. The logits come from
        # two differently compiled programs (a Pallas call vs jnp ops XLA may fuse into the
        # attention that follows), so they agree to float32 rounding, not bitwise (JAX 0.12
        # fuses the jnp path's query rotation differently).
        for g, w in zip(got_logits, want_logits):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    else:
        k, wk = kvp.read_layer(got_pool, 0), kvp.read_layer(want_pool, 0)
        for g, w in zip(k, wk):
            assert rel_err(g, w) < 0.1
        for g, w in zip(got_logits, want_logits):
            assert rel_err(g, w) < 1e-3
    ref_logits, _ = run_steps(params, name, AttentionPlan("reference"))
    for g, r in zip(got_logits, ref_logits):
        assert rel_err(g, r) < 1e-4
