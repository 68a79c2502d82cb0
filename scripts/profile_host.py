"""The engine's host path alone: scheduling, packing and token bookkeeping per step.

A stub device returns constant tokens at once, so every second measured is the engine's own
Python (the real packing code runs; only the jitted step is skipped). The workload is the
benchmark's steady state: `--batch` sequences of 512 prompt tokens decoding together.

    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --num_scheduler_steps 1
    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --num_scheduler_steps 8
"""
from __future__ import annotations

import dataclasses

import time

import numpy as np
from absl import app, flags

from paxkv.config import PRESETS, CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig, runner_config
from paxkv.engine.llm_engine import LLMEngine
from paxkv.engine.step_io import HostSample, StepTiming
from paxkv.runner import Runner
from paxkv.sampling_params import SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 256, "sequences decoding together")
flags.DEFINE_integer("num_scheduler_steps", 1, "decode steps per host round trip")
flags.DEFINE_integer("calls", 100, "engine steps timed after the prefill")


class StubRunner(Runner):
    """The runner's packing on GPU-style fixed shapes, with the device call replaced."""

    def __init__(self, config: RunnerConfig) -> None:  # noqa: D107
        self.config = config
        self._take_shapes(config)
        self.num_compilations = 0

    def swap_out(self, pairs) -> None:
        pass

    swap_in = copy_blocks = swap_out

    def _stub(self, items, rows, steps: int) -> tuple[HostSample, StepTiming]:
        self.pack(items)
        self.pack_sampling(rows)
        n = len(rows)
        shape = (steps, n) if steps > 1 else (n,)
        return (HostSample(np.full(shape, 7, np.int32), np.zeros(shape, np.float32),
                           np.zeros((n, 0), np.int32), np.zeros((n, 0), np.float32)), StepTiming())

    def dispatch(self, items, rows, fill_masks=None):
        return _StubPending(*self._stub(items, rows, 1))

    def dispatch_multi_decode(self, items, rows, num_steps):
        return _StubPending(*self._stub(items, rows, num_steps))

    def fetch(self, pending):
        return pending.host, pending.timing


@dataclasses.dataclass
class _StubPending:
    host: HostSample
    timing: StepTiming
    compile_s: float = 0.0


def main(argv: list[str]) -> None:
    del argv
    cfg = PRESETS["llama3-8b"]
    sched = SchedulerConfig(max_num_seqs=FLAGS.batch, max_num_batched_tokens=8192, max_model_len=2048)
    config = EngineConfig(cfg, CacheConfig(block_size=16, num_gpu_blocks_override=40000), sched,
                          num_scheduler_steps=FLAGS.num_scheduler_steps).with_pool(40000)
    engine = LLMEngine(config, StubRunner(runner_config(config, platform="gpu")), None)
    rng = np.random.default_rng(0)
    for i in range(FLAGS.batch):
        engine.add_request(str(i), rng.integers(0, 1000, size=512).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=1400, ignore_eos=True))
    while engine.scheduler.num_waiting:
        engine.step(only_finished=True)
    first = len(engine.metrics.steps)
    t = time.perf_counter()
    for _ in range(FLAGS.calls):
        engine.step(only_finished=True)
    elapsed = time.perf_counter() - t
    tokens = sum(s.num_decode_tokens for s in engine.metrics.steps[first:])
    per_token_step = elapsed / (tokens / FLAGS.batch)
    print(f"batch {FLAGS.batch}, num_scheduler_steps {FLAGS.num_scheduler_steps}: "
          f"{1e3 * elapsed / FLAGS.calls:.2f} ms per engine step, "
          f"{1e3 * per_token_step:.2f} ms of host Python per decode step of the batch")


if __name__ == "__main__":
    app.run(main)
