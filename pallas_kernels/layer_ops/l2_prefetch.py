"""A kernel that asks for a weight in L2 and does nothing else: `prefetch_to_l2`.

At one decode stream each layer alternates weight matmuls, which read HBM at full bandwidth,
with short latency-bound kernels (norm, RoPE, attention, combine) while HBM idles. Run on a
second stream beside those kernels, this kernel fills that idle time: one thread per chunk
issues `cp.async.bulk.prefetch.L2` (fire and forget, Hopper), so the next matmul finds its
weight, or the part of it it reads first, in L2. It changes no value; in interpret mode it
issues nothing.

The Triton lowering has no prefetch operation, so `prefetch_l2` is a primitive of its own
whose lowering emits the instruction as inline PTX on the weight's base pointer.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import state
from jax._src.state import discharge as state_discharge
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class PrefetchPlan:
    """Which chunks of a weight to prefetch, and how the programs share them.

    Plan index i (program `i // per_program`, lane `i % per_program`) prefetches chunk
    `chunk_index(i)` of the weight's `total` chunks, for i < count: "head" takes the first
    `count` chunks (what a matmul that walks its weight in address order reads first),
    "spread" takes them evenly over the whole weight.
    """

    count: int            # chunks prefetched
    total: int            # chunks in the weight
    chunk_bytes: int
    chunk_elems: int      # chunk_bytes in elements of the weight's dtype
    per_program: int      # chunk addresses per program: a power of two
    programs: int         # programs that issue them
    order: str = "head"

    @property
    def bytes(self) -> int:
        return self.count * self.chunk_bytes


def plan(weight: jax.Array | jax.ShapeDtypeStruct, budget_bytes: int, *,
         chunk_bytes: int = 32 * 1024, per_program: int = 32,
         order: str = "head") -> PrefetchPlan | None:
    """The chunks of `weight` to prefetch within `budget_bytes` (None: nothing to prefetch)."""
    if order not in ("head", "spread"):
        raise ValueError(f"order must be 'head' or 'spread', got {order!r}")
    if chunk_bytes < 16 or chunk_bytes & (chunk_bytes - 1):
        raise ValueError(f"chunk_bytes must be a power of two >= 16, got {chunk_bytes}")
    if per_program < 1 or per_program & (per_program - 1):
        raise ValueError(f"per_program must be a power of two, got {per_program}")
    itemsize = jnp.dtype(weight.dtype).itemsize
    total = math.prod(weight.shape) * itemsize // chunk_bytes
    count = min(total, max(0, budget_bytes) // chunk_bytes)
    if count <= 0:
        return None
    per_program = min(per_program, 1 << (count - 1).bit_length())
    return PrefetchPlan(count=count, total=total, chunk_bytes=chunk_bytes,
                        chunk_elems=chunk_bytes // itemsize, per_program=per_program,
                        programs=-(-count // per_program), order=order)


def chunk_index(i, p: PrefetchPlan):
    """The weight chunk of plan index `i` ("spread": floor(i * total / count), in int32
    without overflow since i * (total % count) < count**2)."""
    if p.order == "head":
        return i
    q, r = divmod(p.total, p.count)
    return i * q + (i * r) // p.count


def _kernel(weight_ref, after_ref, token_ref, *, p: PrefetchPlan):
    del after_ref   # only orders the launch after the kernel that wrote it
    i = pl.program_id(0) * p.per_program + jnp.arange(p.per_program, dtype=jnp.int32)
    i = jnp.minimum(i, p.count - 1)     # the last program's spare lanes repeat a chunk
    prefetch_l2(weight_ref, chunk_index(i, p) * p.chunk_elems, chunk_bytes=p.chunk_bytes)
    token_ref[...] = jnp.zeros(token_ref.shape, token_ref.dtype)


def _whole(a: jax.Array) -> pl.BlockSpec:
    """Hands the kernel the whole array as a pointer; the kernel never loads it."""
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


@functools.partial(jax.jit, static_argnames=("p", "interpret"))
def prefetch_to_l2(weight: jax.Array, after: jax.Array, *, p: PrefetchPlan,
                   interpret: bool = False) -> jax.Array:
    """Ask for plan `p`'s chunks of `weight` in L2, once `after` is written -> an int32 `[1]`
    token (zero) that a consumer can wait on. One warp per program."""
    return pl.pallas_call(
        functools.partial(_kernel, p=p), grid=(p.programs,),
        in_specs=[_whole(weight), _whole(after)],
        out_specs=pl.BlockSpec((1,), lambda i: (0,)),
        out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="paxkv_prefetch_l2",
    )(weight, after)


def prefetch_l2(ref, offsets: jax.Array, *, chunk_bytes: int) -> None:
    """Inside a kernel: ask for `chunk_bytes` of `ref`'s flat array from each element offset in
    `offsets` in L2."""
    _prefetch_p.bind(ref, offsets, chunk_bytes=int(chunk_bytes))


_prefetch_p = jax_core.Primitive("paxkv_prefetch_l2")
_prefetch_p.multiple_results = True


@_prefetch_p.def_effectful_abstract_eval
def _abstract_eval(ref, offsets, **params):
    del offsets, params
    return [], {state.ReadEffect(0)}


def _discharge(*args, **params):
    """Interpret mode: nothing to do (the JAX versions differ in the leading arguments)."""
    del args, params
    return (None, None), []


state_discharge.register_discharge_rule(_prefetch_p)(_discharge)


def _register_triton_lowering() -> None:
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering

    @lowering.register_lowering(_prefetch_p)
    def _lower(ctx, ptr, offsets, *, chunk_bytes):
        shape = ctx.avals_in[1].shape
        ptrs = lowering._add(lowering._bcast_to(ptr, shape), offsets)
        body = f"cp.async.bulk.prefetch.L2.global [$1], {chunk_bytes};"
        i32 = ir.IntegerType.get_signless(32)
        tt_dialect.elementwise_inline_asm(
            [ir.RankedTensorType.get(shape, i32)], f"{{ {body} mov.u32 $0, 0; }}",
            constraints="=r,l", pure=False, packed_element=1, args=[ptrs])
        return []


_register_triton_lowering()
