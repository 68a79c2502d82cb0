"""The engine's host path alone: scheduling, packing and token bookkeeping per step.

A stub device returns constant tokens at once, so every second measured is the engine's own
Python (the real packing into the transfer buffer and the real unpacking of the result run;
only the jitted step and the device transfers are skipped). The workload is the
benchmark's steady state: `--batch` sequences of 512 prompt tokens decoding together.

`--device` runs the same workload on the real runner instead (random weights of `--model`
on the accelerator), so the step also pays JAX's dispatch, the transfers and the wait for
the device, and after the timed steps the last step's program is dispatched back to back
(no engine work between calls, so the device never waits on the host) to measure what
the device alone needs per step: the engine step's exposed host share is 1 - that / the
median engine step. `--cprofile N` prints the N functions with the most own time over the timed
steps, which splits the host's share of a real step between the engine and JAX.

    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --num_scheduler_steps 1
    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --num_scheduler_steps 8
    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --server_outputs   # as in serving
    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --server_outputs --output_kind cumulative
    PYTHONPATH=. python3 scripts/profile_host.py --batch 256 --device --cprofile 40   # on a GPU
"""
from __future__ import annotations

import cProfile
import io
import pstats
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
flags.DEFINE_bool("device", False, "run on the real runner and device instead of the stub")
flags.DEFINE_string("model", "llama3-8b", "with --device: the preset (random weights)")
flags.DEFINE_integer("max_model_len", 2048, "longest sequence (the block tables' width on a GPU)")
flags.DEFINE_integer("cprofile", 0, "print this many functions by own time over the timed steps")
flags.DEFINE_integer("back_to_back", 50, "with --device: repetitions of the last step's program")


class StubRunner(Runner):
    """The runner's packing on GPU-style fixed shapes, with the device call replaced."""

    def __init__(self, config: RunnerConfig) -> None:  # noqa: D107
        self.config = config
        self._take_shapes(config)
        self.num_compilations = 0
        self._pending_offloads = []       # no host KV tier in this workload

    def swap_out(self, pairs) -> None:
        pass

    swap_in = copy_blocks = swap_out

    def _stub(self, items, rows, steps: int) -> PendingStep:
        """Pack as the real dispatch does (into the one transfer buffer) and answer with a
        packed result buffer, so `Runner.fetch` unpacks it for real."""
        t0 = time.perf_counter()
        batch, _, st, _, _ = self.pack_step(items, rows)
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


def back_to_back_ms(runner: Runner, items, rows) -> float:
    """Device time per step of one step's program: dispatched FLAGS.back_to_back times with
    no engine work between, the last one waited for (they run in order on the device)."""
    from scripts.bench_common import dispatched_ms
    return dispatched_ms(lambda: runner.dispatch(items, rows), runner.fetch, FLAGS.back_to_back)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.device:
        from paxkv import LLM
        engine = LLM(FLAGS.model, tokenizer=None, max_num_seqs=FLAGS.batch,
                     max_model_len=FLAGS.max_model_len,
                     num_scheduler_steps=FLAGS.num_scheduler_steps).llm_engine
    else:
        cfg = PRESETS["llama3-8b"]
        sched = SchedulerConfig(max_num_seqs=FLAGS.batch, max_num_batched_tokens=8192,
                                max_model_len=FLAGS.max_model_len)
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
    for _ in range(3):   # the decode buckets' first calls (compilations on a device)
        engine.step(only_finished=not FLAGS.server_outputs)
    last_call: list = []
    if FLAGS.device:   # keep the last step's work to time its program alone afterwards
        dispatch = engine.runner.dispatch

        def recording_dispatch(items, rows, fill_masks=None):
            last_call[:] = [items, rows]
            return dispatch(items, rows, fill_masks)
        engine.runner.dispatch = recording_dispatch
    first = len(engine.metrics.steps)
    durations, rows_s = [], []
    profiler = cProfile.Profile() if FLAGS.cprofile else None
    if profiler is not None:
        profiler.enable()
    for _ in range(FLAGS.calls):
        t = time.perf_counter()
        outs = engine.step(only_finished=not FLAGS.server_outputs)
        durations.append(time.perf_counter() - t)
        if FLAGS.server_outputs:
            t = time.perf_counter()
            streams.rows(outs)
            rows_s.append(time.perf_counter() - t)
    if profiler is not None:
        profiler.disable()
    elapsed = sum(durations)
    tokens = sum(s.num_decode_tokens for s in engine.metrics.steps[first:])
    per_token_step = elapsed / (tokens / FLAGS.batch)
    # The median step is the figure to compare on a shared machine: other processes' bursts
    # lengthen a few steps, and the mean with them.
    print(f"batch {FLAGS.batch}, num_scheduler_steps {FLAGS.num_scheduler_steps}: "
          f"{1e3 * elapsed / FLAGS.calls:.2f} ms per engine step, "
          f"{1e3 * per_token_step:.2f} ms of host Python per decode step of the batch, "
          f"median engine step {1e3 * float(np.median(durations)):.2f} ms")
    steps = engine.metrics.steps[first:]
    device_wait = sum(s.device_s for s in steps)
    print(f"of which waiting for the device: {1e3 * device_wait / FLAGS.calls:.2f} ms per engine step "
          f"({'real device' if FLAGS.device else 'stub'})")
    if FLAGS.server_outputs:
        print(f"streamed rows from the outputs: median {1e3 * float(np.median(rows_s)):.2f} ms per step")
    if FLAGS.device and last_call:
        device_ms = back_to_back_ms(engine.runner, *last_call)
        median = 1e3 * float(np.median(durations))
        print(f"the last step's program back to back: {device_ms:.2f} ms per step (the device alone); "
              f"median engine step {median:.2f} ms; exposed host share {max(0.0, 1 - device_ms / median):.3f}")
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(FLAGS.cprofile)
        print(text.getvalue())


if __name__ == "__main__":
    app.run(main)
