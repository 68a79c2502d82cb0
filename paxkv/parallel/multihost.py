"""One engine over several hosts: JAX's multi-controller model with one scheduler.

Every process runs the same program (`LLM(..., distributed_*=...)`): `jax.distributed.initialize`
joins them, the mesh then spans every process's devices, and every jitted step runs on all of
them at once. Only process 0 (the driver) runs the host side, scheduler and block manager
included. Before each runner call (a step, a block copy, a swap) the driver broadcasts the
call and its arguments (`multihost_utils.broadcast_one_to_all`: a size header, then the
pickled call in a power-of-two bucket so the broadcast compiles a handful of times); the other
processes (workers) make the same call on their own runner, so all processes launch the same
programs in the same order, which is all multi-controller JAX asks. Workers return from
`serve` when the driver's runner is closed.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Mapping

import numpy as np

# Runner methods that touch the device, replayed on every process in the driver's order.
DEVICE_CALLS = ("execute", "execute_multi_decode", "copy_blocks", "swap_out", "swap_in")
_STOP = "stop"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where the processes of one engine meet (`jax.distributed.initialize`'s arguments)."""

    coordinator_address: str | None = None   # "host:port" of process 0
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def enabled(self) -> bool:
        return self.coordinator_address is not None or self.num_processes not in (None, 1)

    def check(self) -> None:
        """ValueError naming the field when the three do not describe one process of a run."""
        if not self.enabled:
            return
        if not self.coordinator_address or ":" not in self.coordinator_address:
            raise ValueError("distributed_coordinator_address must be 'host:port' (process 0's), "
                             f"got {self.coordinator_address!r}")
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"distributed_num_processes must be a positive integer, got "
                             f"{self.num_processes!r}")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"distributed_process_id must be in [0, {self.num_processes}), got "
                             f"{self.process_id!r}")


def llm_kwargs(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, tensor_parallel_size: int | None = None) -> dict[str, Any]:
    """Command-line values (experiments' flags, `paxkv serve`'s arguments) -> LLM keywords.

    Unset values are left out, so LLM's defaults (one process, one device) apply.
    """
    out: dict[str, Any] = {}
    if tensor_parallel_size is not None:
        out["tensor_parallel_size"] = int(tensor_parallel_size)
    if coordinator_address:
        out["distributed_coordinator_address"] = coordinator_address
    if num_processes is not None:
        out["distributed_num_processes"] = int(num_processes)
    if process_id is not None:
        out["distributed_process_id"] = int(process_id)
    return out


def initialize(config: DistributedConfig) -> None:
    """Join the run (once per process, before JAX touches a device)."""
    import jax
    config.check()
    if not config.enabled:
        return
    if jax.distributed.is_initialized():
        return
    # CPU processes need a collectives implementation to talk (tests, CPU clusters); on GPUs
    # NCCL carries the collectives and this setting is unused.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)


def is_driver() -> bool:
    import jax
    return jax.process_index() == 0


def _bucket(n: int) -> int:
    return 1 << max(10, (n - 1).bit_length())


def _broadcast(message: bytes | None) -> bytes:
    """Process 0's `message` on every process (the others pass None)."""
    from jax.experimental import multihost_utils
    n = np.zeros(1, np.int32)
    if message is not None:
        n[0] = len(message)
    n = int(multihost_utils.broadcast_one_to_all(n)[0])
    words = np.zeros(_bucket(n) // 4 + 1, np.int32)
    if message is not None:
        words.view(np.uint8)[:n] = np.frombuffer(message, np.uint8)
    words = np.asarray(multihost_utils.broadcast_one_to_all(words))
    return words.view(np.uint8)[:n].tobytes()


class DriverRunner:
    """Process 0's runner: every device call is announced to the workers, then made.

    Anything else (counters, buckets, the pool) reads through to the runner itself.
    """

    def __init__(self, runner: Any) -> None:
        self._runner = runner
        self._closed = False
        for name in DEVICE_CALLS:
            setattr(self, name, self._forward(name))

    def _forward(self, name: str) -> Any:
        method = getattr(self._runner, name)

        def call(*args: Any) -> Any:
            if self._closed:
                raise RuntimeError("the engine was shut down; its worker processes have exited")
            _broadcast(pickle.dumps((name, args), protocol=pickle.HIGHEST_PROTOCOL))
            return method(*args)
        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def close(self) -> None:
        """Release the workers (they return from `serve`); idempotent."""
        if not self._closed:
            self._closed = True
            _broadcast(pickle.dumps((_STOP, ())))


def serve(runner: Any) -> int:
    """A worker's loop: make the driver's device calls on `runner` until it closes.

    Returns the number of calls made. The messages come from process 0 of this run only.
    """
    calls = 0
    while True:
        name, args = pickle.loads(_broadcast(None))
        if name == _STOP:
            return calls
        if name not in DEVICE_CALLS:
            raise RuntimeError(f"worker received an unknown runner call {name!r}")
        getattr(runner, name)(*args)
        calls += 1


def distributed_config(values: Mapping[str, Any]) -> DistributedConfig:
    """The LLM keywords `distributed_*` -> a DistributedConfig."""
    return DistributedConfig(values.get("distributed_coordinator_address"),
                             values.get("distributed_num_processes"),
                             values.get("distributed_process_id"))
