"""Warm L2 with the next matmul's weights from a kernel that runs before it.

One decode stream alternates weight matmuls, which read HBM at full bandwidth, with short
latency-bound kernels (norm, RoPE, attention, activation) while HBM idles: about a tenth of
each layer's time on an H200. The kernel just before a matmul can take the matmul's weight as
an extra operand and ask for part of it in L2 (`cp.async.bulk.prefetch.L2`, fire and
forget): the memory system starts fetching while that kernel ends and the matmul launches,
and the matmul then finds that part in L2. A prefetch is a hint: it changes no value, and in
interpret mode the kernels leave it out.

The prefetched chunks are spread evenly over the weight, so each
program of XLA's matmul finds about the same share of its bytes in L2, whatever its tiling
and split of K.

The module's settings (BUDGETS, MAX_ROWS, ENABLED, PLACE, ...) are read when a kernel or a
model step is traced: set them before the engine compiles (`jax.clear_caches()` otherwise).

The Triton lowering has no prefetch operation, so `prefetch_l2` is a primitive of its own
whose lowering emits the instruction as inline PTX on the weight's base pointer.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import state
from jax._src.state import discharge as state_discharge


# Bytes per prefetch instruction, and the number of extra programs a plan aims for.
CHUNK_BYTES = 32 * 1024
TARGET_PROGRAMS = 32
# "bulk": one `cp.async.bulk.prefetch.L2` per chunk (the copy engine walks it; Hopper);
# "line": one `prefetch.global.L2` per 128-byte line of the chunk (any sm_80+ GPU).
MODE = "bulk"
# "tail": the kernel's own programs issue the prefetch after their work, so the window's
# other loads are not queued behind it; "extra": programs of their own, beside the work.
PLACE = "tail"

# Bytes of the next weight each site warms, for steps of at most MAX_ROWS tokens: "qkv" from
# the norm before the q/k/v matmul, "o" from decode attention's split combine, "gate_up" from
# the norm after attention, "down" from the SwiGLU kernel. Larger steps keep their own kernels
# busy longer and their matmuls nearer compute, and warm nothing.
BUDGETS = {"qkv": 16 << 20, "o": 32 << 20, "gate_up": 16 << 20, "down": 8 << 20}
MAX_ROWS = 16
# None: warm only where the kernels are compiled for a GPU (in interpret mode a prefetch is a
# no-op that still runs its extra programs); True or False forces it, for tests and ablations.
ENABLED: bool | None = None


def budget(site: str, rows: int) -> int:
    """Bytes to warm at `site` (a key of BUDGETS) for a step of `rows` tokens; 0: none."""
    enabled = jax.default_backend() == "gpu" if ENABLED is None else ENABLED
    if not enabled or rows > MAX_ROWS:
        return 0
    return BUDGETS.get(site, 0)


@dataclasses.dataclass(frozen=True)
class PrefetchPlan:
    """Which chunks of a weight to prefetch, and how the extra programs share them.

    Plan index i (program `i // per_program`, lane `i % per_program`) prefetches chunk
    `floor(i * total / count)` of the weight's `total` chunks, for i < count: evenly spread.
    """

    count: int            # chunks prefetched
    total: int            # chunks in the weight
    chunk_bytes: int
    chunk_elems: int      # chunk_bytes in elements of the weight's dtype
    per_program: int      # chunk addresses per program: a power of two
    programs: int         # programs that issue them
    tail: bool = False    # issued by the work programs after their work (PLACE "tail")

    @property
    def bytes(self) -> int:
        return self.count * self.chunk_bytes


def plan(weight: jax.Array | jax.ShapeDtypeStruct, budget_bytes: int, *,
         chunk_bytes: int | None = None, target_programs: int | None = None,
         tail: bool = False) -> PrefetchPlan | None:
    """The chunks of `weight` to prefetch within `budget_bytes` (None: nothing to prefetch).
    `chunk_bytes`, `target_programs` None: the module's CHUNK_BYTES and TARGET_PROGRAMS."""
    if budget_bytes <= 0:
        return None
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    target_programs = TARGET_PROGRAMS if target_programs is None else target_programs
    itemsize = jnp.dtype(weight.dtype).itemsize
    if chunk_bytes < 16 or chunk_bytes & (chunk_bytes - 1):
        raise ValueError(f"chunk_bytes must be a power of two >= 16, got {chunk_bytes}")
    total = math.prod(weight.shape) * itemsize // chunk_bytes
    count = min(total, budget_bytes // chunk_bytes)
    if count <= 0:
        return None
    per_program = 1 << (max(1, -(-count // max(1, target_programs))) - 1).bit_length()
    return PrefetchPlan(count=count, total=total, chunk_bytes=chunk_bytes,
                        chunk_elems=chunk_bytes // itemsize, per_program=per_program,
                        programs=-(-count // per_program), tail=tail)


def kernel_plan(weight: jax.Array | None, budget_bytes: int, interpret: bool,
                work_programs: int) -> PrefetchPlan | None:
    """`plan` for a kernel of `work_programs` programs and its `prefetch` operand, placed as
    PLACE says: None without one, and in interpret mode, where a prefetch does nothing (and
    the interpreter cannot run a kernel body that reads its program id under a condition)."""
    if weight is None or interpret:
        return None
    if PLACE == "tail":
        return plan(weight, budget_bytes, target_programs=work_programs, tail=True)
    if PLACE != "extra":
        raise ValueError(f"PLACE must be 'tail' or 'extra', got {PLACE!r}")
    return plan(weight, budget_bytes)


def whole(weight: jax.Array):
    """The block spec that hands a kernel the whole weight, whatever its grid."""
    from jax.experimental import pallas as pl
    return pl.BlockSpec(weight.shape, lambda *_: (0,) * weight.ndim)


def with_prefetch_programs(body, work_rows: int, p: PrefetchPlan | None,
                           inner: tuple[int, ...] = ()):
    """A kernel that runs `body(*refs)` where grid axis 0 is below `work_rows` and, with a
    plan, takes the weight as its first operand and prefetches it: from the work programs
    after their work (`p.tail`), or from the rows after `work_rows` (`extra_rows` of them).
    `inner`: the sizes of the grid's other axes, whose programs each issue their own share."""
    if p is None:
        return body
    from jax.experimental import pallas as pl

    def kernel(weight_ref, *refs):
        i = pl.program_id(0)
        program = i if p.tail else i - work_rows
        for axis, size in enumerate(inner, start=1):
            program = program * size + pl.program_id(axis)
        if p.tail:
            body(*refs)
            issuing = program < p.programs
        else:
            @pl.when(i < work_rows)
            def _():
                body(*refs)

            issuing = (i >= work_rows) & (program < p.programs)

        @pl.when(issuing)
        def _():
            issue(weight_ref, program, p)

    return kernel


def extra_rows(p: PrefetchPlan | None, inner: tuple[int, ...] = ()) -> int:
    """Rows of grid axis 0 that `with_prefetch_programs` adds for plan `p`."""
    return 0 if p is None or p.tail else -(-p.programs // math.prod(inner))


def issue(weight_ref, program: jax.Array, p: PrefetchPlan) -> None:
    """Inside a kernel: prefetch program `program`'s chunks of `p` (0 <= program < p.programs).

    `weight_ref` is the weight as the kernel received it, whole (a block spec covering the
    array; it is never loaded)."""
    i = program * p.per_program + jnp.arange(p.per_program, dtype=jnp.int32)
    i = jnp.minimum(i, p.count - 1)     # the last program's spare lanes repeat a chunk
    prefetch_l2(weight_ref, chunk_index(i, p) * p.chunk_elems, chunk_bytes=p.chunk_bytes)


def chunk_index(i, p: PrefetchPlan):
    """The weight chunk of plan index `i`: floor(i * total / count), in int32 without
    overflow (i * (total % count) < count**2)."""
    q, r = divmod(p.total, p.count)
    return i * q + (i * r) // p.count


def prefetch_l2(ref, offsets: jax.Array, *, chunk_bytes: int, mode: str | None = None) -> None:
    """Ask for `chunk_bytes` of `ref`'s flat array from each element offset in `offsets` in L2
    (`mode` None: MODE)."""
    mode = MODE if mode is None else mode
    if mode not in ("bulk", "line"):
        raise ValueError(f"mode must be 'bulk' or 'line', got {mode!r}")
    _prefetch_p.bind(ref, offsets, chunk_bytes=int(chunk_bytes), mode=mode)


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
    def _lower(ctx, ptr, offsets, *, chunk_bytes, mode):
        shape = ctx.avals_in[1].shape
        ptrs = lowering._add(lowering._bcast_to(ptr, shape), offsets)
        if mode == "bulk":
            body = f"cp.async.bulk.prefetch.L2.global [$1], {chunk_bytes};"
        else:
            body = " ".join(f"prefetch.global.L2 [$1+{o}];" for o in range(0, chunk_bytes, 128))
        i32 = ir.IntegerType.get_signless(32)
        tt_dialect.elementwise_inline_asm(
            [ir.RankedTensorType.get(shape, i32)], f"{{ {body} mov.u32 $0, 0; }}",
            constraints="=r,l", pure=False, packed_element=1, args=[ptrs])
        return []


_register_triton_lowering()
