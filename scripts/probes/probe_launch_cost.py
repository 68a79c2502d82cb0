"""The host cost of launching the jitted step, one stream and a 256-row batch, under the XLA_FLAGS
the process was started with (compare command-buffer settings, one process each):

    PAXKV_COMPILATION_CACHE_DIR=off XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
        PYTHONPATH=. python3 scripts/probes/probe_launch_cost.py

Prints one RESULT line: tokens/s, the median time inside Runner.dispatch, and the median
wall, host and device-wait times of full-batch decode steps.
"""
import os, time, statistics, json
t0 = time.perf_counter()
from paxkv import LLM, SamplingParams
llm = LLM("llama3-8b", tokenizer=None, seed=0)
eng = llm.llm_engine
runner = eng.runner
disp = []
orig = runner.dispatch
def timed(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k); disp.append(time.perf_counter() - t); return r
runner.dispatch = timed
res = {"flags": os.environ.get("XLA_FLAGS", ""), "setup_s": time.perf_counter() - t0}
prompt = list(range(100, 228))
sp = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True, detokenize=False)
llm.generate([prompt], sp, use_tqdm=False)
tps = []
for rep in range(3):
    disp.clear(); eng.metrics.reset()
    t = time.perf_counter(); llm.generate([prompt], sp, use_tqdm=False); el = time.perf_counter() - t
    tps.append(512 / el)
res["stream_tok_s"] = tps
res["stream_dispatch_ms_median"] = 1e3 * statistics.median(disp)
res["stream_host_share"] = eng.metrics.summary()["host_share"]
prompts = [[(7 * i + j) % 5000 + 10 for j in range(128)] for i in range(256)]
spb = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, detokenize=False)
llm.generate(prompts, spb, use_tqdm=False)
walls = []
for rep in range(2):
    disp.clear(); eng.metrics.reset()
    t = time.perf_counter(); llm.generate(prompts, spb, use_tqdm=False); walls.append(time.perf_counter() - t)
steps = [s for s in eng.metrics.steps if s.num_seqs_scheduled == 256 and s.num_prefill_tokens == 0] if hasattr(eng.metrics, "steps") else []
res["batch_wall_s"] = walls
res["batch_dispatch_ms_median"] = 1e3 * statistics.median(disp)
if steps:
    res["full_batch_wall_ms"] = 1e3 * statistics.median(s.wall_s for s in steps)
    res["full_batch_host_ms"] = 1e3 * statistics.median(s.host_s for s in steps)
    res["full_batch_device_wait_ms"] = 1e3 * statistics.median(s.device_s for s in steps)
print("RESULT", json.dumps(res), flush=True)
