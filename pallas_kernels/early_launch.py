"""Let the kernel after a Pallas kernel launch early (programmatic dependent launch, Hopper).

XLA launches its own kernels with programmatic dependent launch (PDL) on Hopper GPUs: each one
waits for its predecessor's results inside the kernel (`griddepcontrol.wait` at its entry),
so the GPU may start it before the predecessor ends. It starts it once every block of the
predecessor has executed `griddepcontrol.launch_dependents`, or has exited. XLA's matmuls
release their successor after their main loop; a Pallas kernel never does, so the weight
matmul after one of the small layer kernels (add + RMSNorm, the attention's split combine)
is only launched when that kernel's last block exits.

`release_dependents` executes `griddepcontrol.launch_dependents` at the start of a Pallas
(Triton) kernel, so a matmul that XLA launched with PDL can have its blocks placed on the
idle SMs while the small kernel runs; its own wait still orders every read of the small
kernel's outputs after that kernel has finished and its writes are visible. A kernel not
launched with PDL ignores the release, so it changes no value anywhere; in interpret mode it
does nothing.

`ENABLED` is read when a kernel is traced: set it before the engine compiles.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import state
from jax._src.state import discharge as state_discharge

# None: release where the kernel is compiled for a GPU; False: never (the ablation).
ENABLED: bool | None = None


def enabled(interpret: bool) -> bool:
    """Whether a kernel traced now, in or out of interpret mode, releases its dependents."""
    if interpret:
        return False
    return jax.default_backend() == "gpu" if ENABLED is None else ENABLED


def release_dependents(ref) -> None:
    """Inside a Pallas Triton kernel: allow the dependent kernel to launch now.

    `ref` is any of the kernel's operands; it is never read (the instruction needs an
    operand to attach to, and the read effect keeps it in the program)."""
    _release_p.bind(ref, jnp.zeros((1,), jnp.int32))


_release_p = jax_core.Primitive("paxkv_launch_dependents")
_release_p.multiple_results = True


@_release_p.def_effectful_abstract_eval
def _abstract_eval(ref, lane):
    del lane
    return [], {state.ReadEffect(0)}


def _discharge(*args, **params):
    """Interpret mode: nothing to do."""
    del args, params
    return (None, None), []


state_discharge.register_discharge_rule(_release_p)(_discharge)


def _register_triton_lowering() -> None:
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering

    @lowering.register_lowering(_release_p)
    def _lower(ctx, ptr, lane):
        shape = ctx.avals_in[1].shape
        ptrs = lowering._add(lowering._bcast_to(ptr, shape), lane)
        i32 = ir.IntegerType.get_signless(32)
        tt_dialect.elementwise_inline_asm(
            [ir.RankedTensorType.get(shape, i32)],
            "{ griddepcontrol.launch_dependents; mov.u32 $0, 0; }",
            constraints="=r,l", pure=False, packed_element=1, args=[ptrs])
        return []


_register_triton_lowering()
