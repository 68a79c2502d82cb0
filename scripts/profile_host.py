"""The engine's host path alone: scheduling, packing and token bookkeeping per step.

A stub device returns constant tokens at once, so every second measured is the engine's own
Python (the real packing into the transfer buffer and the real unpacking of the result run;
only the jitted step and the device transfers are skipped). The workload is the
benchmark's steady state: `--batch` sequences of 512 prompt tokens decoding together.

    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --num_scheduler_steps 1
    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --num_scheduler_steps 8
    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --server_outputs   # as in serving
    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --server_outputs --output_kind cumulative
"""
from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from paxkv.config import PRESETS, CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig, runner_config
from paxkv.engine.llm_engine import LLMEngine
from paxkv.runner import Runner, transfer
from paxkv.runner.runner import PendingStep
from paxkv.sampling_params import RequestOutputKind, SamplingParams
from paxkv.serve.streams import OutputRows

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 256, "sequences decoding together")
flags.DEFINE_integer("num_scheduler_steps", 1, "decode steps per host round trip")
flags.DEFINE_integer("calls", 100, "engine steps timed after the prefill")
flags.DEFINE_bool("server_outputs", False, "as `paxkv serve`'s engine process: every step returns "
                  "each changed request's output and turns it into streamed rows")
flags.DEFINE_enum("output_kind", "delta", ["delta", "cumulative"],
                  "with --server_outputs: the RequestOutputKind of the streamed requests")


class StubRunner(Runner):
    """The runner's packing on GPU-style fixed shapes, with the device call replaced."""

    def __init__(self, config: RunnerConfig) -> None:  # noqa: D107
        self.config = config
        self._take_shapes(config)
        self.num_compilations = 0

    def swap_out(self, pairs) -> None:
        pass

    swap_in = copy_blocks = swap_out

    def _stub(self, items, rows, steps: int) -> PendingStep:
        """Pack as the real dispatch does (into the one transfer buffer) and answer with a
        packed result buffer, so `Runner.fetch` unpacks it for real."""
        t0 = time.perf_counter()
        batch, _ = self.pack(items)
        st, _, _ = self.pack_sampling(rows)
        transfer.pack_host(tuple(batch) + tuple(st) + (np.zeros(0, np.int32),))
        n = len(rows)
        r = st.seeds.shape[0]
        if steps > 1:
            shape = (steps, batch.context_lens.shape[0])
            out_spec = ((shape, "int32"), (shape, "float32"))
        else:
            out_spec = (((r,), "int32"), ((r,), "float32"), ((r, 0), "int32"), ((r, 0), "float32"),
                        ((0,), "float32"), ((0, 0), "int32"), ((0, 0), "float32"))
        out = np.concatenate([np.full(shape, 7 if dtype == "int32" else 0, np.int32).reshape(-1)
                              for shape, dtype in out_spec])
        return PendingStep(out, out_spec, n, 0, (), False, t0, time.perf_counter(), 0.0,
                           multi=steps > 1)

    def dispatch(self, items, rows, fill_masks=None):
        return self._stub(items, rows, 1)

    def dispatch_multi_decode(self, items, rows, num_steps):
        return self._stub(items, rows, num_steps)


def main(argv: list[str]) -> None:
    del argv
    cfg = PRESETS["llama3-8b"]
    sched = SchedulerConfig(max_num_seqs=FLAGS.batch, max_num_batched_tokens=8192, max_model_len=2048)
    config = EngineConfig(cfg, CacheConfig(block_size=16, num_gpu_blocks_override=40000), sched,
                          num_scheduler_steps=FLAGS.num_scheduler_steps).with_pool(40000)
    engine = LLMEngine(config, StubRunner(runner_config(config, platform="gpu")), None)
    rng = np.random.default_rng(0)
    streams = OutputRows()
    delta = FLAGS.server_outputs and FLAGS.output_kind == "delta"
    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE
    for i in range(FLAGS.batch):
        engine.add_request(str(i), rng.integers(0, 1000, size=512).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=1400, ignore_eos=True,
                                          detokenize=not FLAGS.server_outputs, output_kind=kind))
        streams.track(str(i), i, stream=True, delta=delta)
    while engine.scheduler.num_waiting:
        engine.step(only_finished=True)
    first = len(engine.metrics.steps)
    durations, rows_s = [], []
    for _ in range(FLAGS.calls):
        t = time.perf_counter()
        outs = engine.step(only_finished=not FLAGS.server_outputs)
        durations.append(time.perf_counter() - t)
        if FLAGS.server_outputs:
            t = time.perf_counter()
            streams.rows(outs)
            rows_s.append(time.perf_counter() - t)
    elapsed = sum(durations)
    tokens = sum(s.num_decode_tokens for s in engine.metrics.steps[first:])
    per_token_step = elapsed / (tokens / FLAGS.batch)
    # The median step is the figure to compare on a shared machine: other processes' bursts
    # lengthen a few steps, and the mean with them.
    print(f"batch {FLAGS.batch}, num_scheduler_steps {FLAGS.num_scheduler_steps}: "
          f"{1e3 * elapsed / FLAGS.calls:.2f} ms per engine step, "
          f"{1e3 * per_token_step:.2f} ms of host Python per decode step of the batch, "
          f"median engine step {1e3 * float(np.median(durations)):.2f} ms")
    if FLAGS.server_outputs:
        print(f"streamed rows from the outputs: median {1e3 * float(np.median(rows_s)):.2f} ms per step")


if __name__ == "__main__":
    app.run(main)
