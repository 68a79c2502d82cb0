"""One engine over several hosts: JAX's multi-controller model with one scheduler.

Every process calls `LLM(..., distributed_*=...)` (or runs `python -m paxkv.parallel.worker`
with the same three flags): `jax.distributed.initialize` joins them, the mesh then spans every
process's devices, and every jitted program runs on all of them at once. Only process 0 (the
driver) runs the host side, scheduler and block manager included, and the program around it.

The driver announces each engine it builds (its LLM arguments), and before each runner call
(a step, a block copy, a swap) it broadcasts the call and its arguments
(`multihost_utils.broadcast_one_to_all`: a size header, then the pickled message in a
power-of-two bucket, so the broadcast compiles a handful of times). The other processes
(workers) build the same engine and make the same calls on their own runner, so all
processes launch the same programs in the same order, which is all multi-controller JAX
asks. One engine spans the hosts at a time: building the next one closes the last.
Workers return when the driver's program exits.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import numpy as np

# Runner methods that touch the device, replayed on every process in the driver's order.
DEVICE_CALLS = ("dispatch", "dispatch_multi_decode", "copy_blocks", "swap_out", "swap_in",
                "offload", "load")
# Block movements the engine asks for on every step, mostly with nothing to move: an empty
# one touches no device, so it is not announced.
_BLOCK_MOVES = ("copy_blocks", "swap_out", "swap_in", "offload", "load")
_STOP = "stop"        # the current engine is closed
_ENGINE = "engine"     # build an engine: LLM keyword arguments follow
_EXIT = "exit"         # the driver's program is over


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


def _send(*message: Any) -> None:
    _broadcast(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive() -> tuple[Any, ...]:
    return pickle.loads(_broadcast(None))


_current: "DriverRunner | None" = None
_exit_registered = False


def announce_engine(llm_kwargs: dict[str, Any]) -> None:
    """Driver: tell the workers to build an engine with these LLM arguments (closing the
    last one). Weights cannot travel this way: workers load or build their own shards."""
    global _exit_registered
    if llm_kwargs.get("params") is not None:
        raise ValueError("params cannot be passed to a multi-host engine: give a checkpoint "
                         "directory or a preset, and every process loads its own shards")
    if _current is not None:
        _current.close()
    if not _exit_registered:
        import atexit
        atexit.register(_send, _EXIT)   # workers must not outlive the driver's program
        _exit_registered = True
    kwargs = {k: v for k, v in llm_kwargs.items() if not k.startswith("distributed_")}
    kwargs["tokenizer"] = None          # workers never tokenize
    _send(_ENGINE, kwargs)


def agree(value: int) -> int:
    """Process 0's `value` on every process (e.g. the pool size each one measured)."""
    from jax.experimental import multihost_utils
    return int(multihost_utils.broadcast_one_to_all(np.array([value], np.int32))[0])


def run_worker(build: Any) -> int:
    """A worker process: build every engine the driver announces (`build(kwargs)` returns
    its runner) and make the driver's device calls on it, in the driver's order, until the
    driver's program exits. Returns the number of calls made."""
    runner, calls = None, 0
    while True:
        kind, *rest = _receive()
        if kind == _EXIT:
            return calls
        if kind == _ENGINE:
            runner = build(rest[0])
        elif kind == _STOP:
            runner = None
        elif kind in DEVICE_CALLS and runner is not None:
            getattr(runner, kind)(*rest[0])
            calls += 1
        else:
            raise RuntimeError(f"worker received {kind!r} with no engine to run it on")


class DriverRunner:
    """Process 0's runner: every device call is announced to the workers, then made.

    Anything else (counters, buckets, the pool) reads through to the runner itself.
    """

    def __init__(self, runner: Any) -> None:
        global _current
        self._runner = runner
        self._closed = False
        for name in DEVICE_CALLS:
            setattr(self, name, self._forward(name))
        _current = self

    def _forward(self, name: str) -> Any:
        method = getattr(self._runner, name)

        def call(*args: Any) -> Any:
            if self._closed:
                raise RuntimeError("this multi-host engine was shut down (or a newer one built)")
            if name not in _BLOCK_MOVES or args[0]:
                _send(name, args)
            return method(*args)
        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def close(self) -> None:
        """End this engine on the workers (they wait for the next one); idempotent."""
        global _current
        if not self._closed:
            self._closed = True
            _send(_STOP, ())
            if _current is self:
                _current = None
