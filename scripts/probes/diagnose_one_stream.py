"""One stream of 128 in / 512 out on the Llama-3-8B preset (random bf16 weights): tokens/s in
two timed repetitions after a warm-up, a digest of the greedy output's token ids (variants
that change no value print the same one, given the same matmul tilings), whether the engine ran
asynchronously, and a cProfile of the host over a third repetition (where the host time of a
step goes).

    PYTHONPATH=. python3 scripts/probes/diagnose_one_stream.py
    PYTHONPATH=<another commit's paxkv>:. python3 scripts/probes/diagnose_one_stream.py   # compare commits
    PYTHONPATH=. python3 scripts/probes/diagnose_one_stream.py --noprofile   # the timed runs only
"""
import cProfile, hashlib, pstats, sys, time, io
t0 = time.perf_counter()
from paxkv import LLM, SamplingParams
llm = LLM("llama3-8b", tokenizer=None, seed=0)
eng = llm.llm_engine
print("setup_s", round(time.perf_counter() - t0, 1), "backend", getattr(eng.runner, "backend", None), flush=True)
prompt = list(range(100, 228))
sp = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True, detokenize=False)
llm.generate([prompt], sp, use_tqdm=False)
for rep in range(2):
    eng.metrics.reset()
    t = time.perf_counter(); out = llm.generate([prompt], sp, use_tqdm=False); el = time.perf_counter() - t
    s = eng.metrics.summary()
    ids = list(out[0].outputs[0].token_ids)
    digest = hashlib.sha1(repr(ids).encode()).hexdigest()[:12]
    print(f"rep{rep} tok/s {512/el:.1f} host_share {s.get('host_share'):.3f} compile_s {s.get('compile_s'):.2f} "
          f"tokens {digest} first {ids[:6]}", flush=True)
print("async", getattr(eng, "async_scheduling", None), "needs_sync?", eng._needs_sync() if hasattr(eng, "_needs_sync") else None)
if "--noprofile" in sys.argv:
    sys.exit(0)
pr = cProfile.Profile(); pr.enable()
t = time.perf_counter(); llm.generate([prompt], sp, use_tqdm=False); el = time.perf_counter() - t
pr.disable()
print(f"profiled tok/s {512/el:.1f}")
buf = io.StringIO(); st = pstats.Stats(pr, stream=buf); st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_stats(30)
print("\n".join(l for l in buf.getvalue().splitlines() if l.strip())[:6000])
