"""EAGLE speculative decoding in the engine (`speculative_config={"method": "eagle", "model":
HEAD_FILE, ...}`): greedy outputs equal to the engine without speculation, seeded sampling
reproducible; each sequence's window holds the target's real features (a dense forward's
final-norm output); the engine's drafts are the offline `eagle.draft` of those windows; a
head that drafts the target's own greedy choice is accepted exactly as a replay predicts;
bad heads are named; no block or window is left behind.

The heads are not trained: a random one (almost nothing kept) and an "echo" head whose
predicted feature is its input feature, so its drafts repeat the target's greedy choice at
the newest position (kept exactly where the target repeats a token).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import assert_no_leaks
from paxkv import LLM, SamplingParams
from paxkv.model.dense import dense_forward_jit
from paxkv.model.weights import write_safetensors
from paxkv.spec_decode import eagle

ENGINE = dict(dtype="float32", max_num_seqs=8, max_model_len=256, num_gpu_blocks_override=120)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def _llm(head: str | None = None, k: int = 3, **overrides) -> LLM:
    """The engine without speculation (head None) or with the `head` ("random", "echo")."""
    spec = None if head is None else {"method": "eagle", "model": _head_file(head),
                                      "num_speculative_tokens": k}
    return LLM("tiny", speculative_config=spec, **{**ENGINE, **dict(overrides)})


def _target():
    return _llm().llm_engine.runner.params, _llm().model_config


@functools.lru_cache(maxsize=None)
def _head(kind: str):
    """Random init, or the echo head: `fc` passes the feature half through and the layer adds
    nothing (its weights zero), so the prediction of f_{t+1} is f_t."""
    _, cfg = _target()
    head = eagle.init_head(cfg, jax.random.PRNGKey(0))
    if kind == "echo":
        h = cfg.hidden_size
        head = jax.tree.map(jnp.zeros_like, head)
        head["fc"]["kernel"] = jnp.zeros((2 * h, h)).at[h:].set(jnp.eye(h))
    return head


_FILES: dict[str, str] = {}


def _head_file(kind: str) -> str:
    if kind not in _FILES:
        import tempfile
        path = f"{tempfile.mkdtemp(prefix='paxkv-eagle-')}/{kind}.safetensors"
        write_safetensors(path, eagle.flatten_head(_head(kind)))
        _FILES[kind] = path
    return _FILES[kind]


def _prompts(seed: int = 0) -> list:
    """Lengths ending mid-block (block size 16), one longer than the head's window; another
    `seed` for prompts the prefix cache has not seen."""
    rng = np.random.default_rng(seed)
    vocab = _llm().model_config.vocab_size
    return ["It was a fine morning, and she said that it was a fine morning, and"] + [
        rng.integers(3, vocab, n).tolist() for n in (5, 30, 61, eagle.WINDOW + 12)]


def _tokens(llm: LLM, prompts, sp=GREEDY) -> list:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def _features(ids: list[int]) -> np.ndarray:
    """The target's final-norm output at every position of `ids`, from the dense forward."""
    params, cfg = _target()
    _, _, hidden = dense_forward_jit(params, jnp.asarray([ids], jnp.int32), cfg,
                                     hidden_layers=(cfg.num_layers,))
    return np.asarray(hidden[:, 0])


_draft = jax.jit(eagle.draft, static_argnums=(1, 6))


def _offline_drafts(window, k: int) -> list[int]:
    """`eagle.draft` (one window, not batched) on a proposer's window."""
    params, cfg = _target()
    feats, toks = window
    n, w = len(toks), eagle.WINDOW
    f = np.zeros((w, cfg.hidden_size), np.float32)
    t = np.zeros((w,), np.int32)
    f[w - n:], t[w - n:] = feats, toks
    return np.asarray(_draft(_head("random"), cfg, params["embed_tokens"]["embedding"],
                             f, t, n, k)).tolist()


@pytest.mark.parametrize("k", [2, 3])
def test_greedy_equals_no_speculation(k):
    llm = _llm("random", k)
    m = llm.llm_engine.metrics
    drafted = m.spec_decode_num_draft_tokens
    assert _tokens(llm, _prompts()) == _tokens(_llm(), _prompts())
    assert m.spec_decode_num_draft_tokens - drafted > 50        # verify steps did run
    proposer = llm.llm_engine.proposer
    assert not proposer._windows                               # finished: windows dropped
    assert proposer.drafter.batch_sizes <= {1, 2, 4, 8}
    assert_no_leaks(llm)


def test_seeded_sampling_reproduces():
    llm = _llm("random", 3)
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=20, ignore_eos=True)
    prompts = _prompts()[:3]
    assert _tokens(llm, prompts, sp) == _tokens(llm, prompts, sp)
    assert_no_leaks(llm)


LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)


def _run_steps(engine, prompts, num_steps: int, sp=LONG) -> list:
    """Queue `prompts`, run `num_steps` steps; -> their sequences (running, not finished)."""
    ids = []
    for i, p in enumerate(prompts):
        rid = f"w{i}-{len(engine.requests)}"
        engine.add_request(rid, p, sp)
        ids.append(rid)
    for _ in range(num_steps):
        engine.step()
    return [engine.requests[r].samples[0] for r in ids]


@pytest.mark.parametrize("chunk", [None, 32])
def test_windows_hold_the_targets_features(chunk):
    """After prefill (whole or in chunks of 32) and a few verify steps, each sequence's window
    is the dense forward's final-norm output at its last min(WINDOW, len - 1) positions, and
    the next tokens are the sequence's own."""
    kw = {} if chunk is None else dict(max_num_batched_tokens=chunk)
    llm = _llm("random", 3, **kw)
    engine = llm.llm_engine
    prompts = _prompts(seed=1 if chunk is None else 2)[1:]   # no prefix-cache hit
    seqs = _run_steps(engine, prompts, 20)
    try:
        for seq in seqs:
            ids = list(seq.token_ids)
            assert len(ids) > len(seq.prompt_token_ids) + 1
            feats, toks = engine.proposer.window_of(seq)
            n = min(eagle.WINDOW, len(ids) - 1)
            assert feats.shape == (n, llm.model_config.hidden_size)
            assert toks.tolist() == ids[len(ids) - n:]
            want = _features(ids)[len(ids) - 1 - n:len(ids) - 1]
            np.testing.assert_allclose(feats, want, atol=1e-4, rtol=1e-4)
    finally:
        engine.abort_request([s.request_id for s in seqs])
        engine.step()
    assert not engine.proposer._windows
    assert_no_leaks(llm)


def _recorded_generate(llm: LLM, prompts, sp) -> tuple[list, list]:
    """`llm.generate` recording each proposal: -> (outputs, [(request id, window start,
    window, room, drafts)] for the sequences that had a window)."""
    proposer = llm.llm_engine.proposer
    seen = []
    propose = proposer.propose

    def recording(seqs, rooms):
        windows = [proposer.window_of(s) if r > 0 else None for s, r in zip(seqs, rooms)]
        drafts = propose(seqs, rooms)
        for s, w, r, d in zip(seqs, windows, rooms, drafts):
            if w is not None:
                seen.append((s.request_id, len(s.token_ids) - 1 - len(w[1]), w, r, d))
        return drafts

    proposer.propose = recording
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:   # the wrapper holds the proposer: drop the cycle
        del proposer.propose
    return outs, seen


def _assert_windows_are_features(outs, seen) -> None:
    """Each recorded window is the dense forward's features of its request's final tokens
    at the window's positions (features depend only on the tokens up to their position)."""
    ids = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    feats = {rid: _features(t) for rid, t in ids.items()}
    for rid, lo, (f, t), _, _ in seen:
        assert t.tolist() == ids[rid][lo + 1:lo + 1 + len(t)]
        np.testing.assert_allclose(f, feats[rid][lo:lo + len(t)], atol=1e-4, rtol=1e-4)


def test_engine_drafts_are_the_offline_drafts():
    """Every proposal of a run (batches of up to 5 windows, padded to 8) equals `eagle.draft`
    on the same window, one at a time."""
    llm = _llm("random", 3)
    _, seen = _recorded_generate(llm, _prompts(), SamplingParams(temperature=0.0, max_tokens=8,
                                                                 ignore_eos=True))
    assert len(seen) > 10
    for _, _, window, room, drafts in seen:
        assert drafts == _offline_drafts(window, 3)[:room]
    assert_no_leaks(llm)


def _replayed_kept(ids: list[int], num_prompt: int, max_tokens: int, k: int) -> int:
    """Drafts kept when each verify step drafts the newest token k times (the echo head),
    along greedy output `ids` of one sequence decoding alone."""
    n, kept = num_prompt + 1, 0          # the prefill emitted the first output token
    while n - num_prompt < max_tokens:
        room = min(k, max_tokens - (n - num_prompt) - 1)
        j = 0
        while j < room and ids[n + j] == ids[n - 1]:
            j += 1
        kept += j
        n += j + 1
    return kept


def test_a_head_drafting_the_targets_choice_is_accepted():
    """The echo head drafts argmax(embedding . f_n), the target's greedy choice at the newest
    position, i.e. the newest token, k times: where the target repeats a token it is kept.
    The drafts kept equal the replay's count, and the output equals the plain engine's."""
    prompt = "Ha ha ha ha ha ha ha ha ha"       # the tiny model answers "ddddddd, and ..."
    k, sp = 3, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm = _llm("echo", k)
    m = llm.llm_engine.metrics
    kept = m.spec_decode_num_accepted_tokens
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert [out.outputs[0].token_ids] == _tokens(_llm(), [prompt], sp)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    want = _replayed_kept(ids, len(out.prompt_token_ids), sp.max_tokens, k)
    assert want >= 4
    assert m.spec_decode_num_accepted_tokens - kept == want
    assert_no_leaks(llm)


def test_forks_and_prefix_hits_keep_correct_windows():
    """n = 2 samples fork the prompt's window; a second request of the same prompt hits the
    prefix cache (its cached positions never ran: a shorter window, still the target's
    features at the positions it holds). Greedy tokens equal the plain engine's."""
    llm = _llm("random", 3)
    engine = llm.llm_engine
    prompt = _prompts()[3]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    assert _tokens(llm, [prompt], sp) == _tokens(_llm(), [prompt], sp)
    seqs = _run_steps(engine, [prompt], 3)
    try:
        seq = seqs[0]
        ids = list(seq.token_ids)
        feats, toks = engine.proposer.window_of(seq)
        n = len(toks)
        assert n < len(ids) - 1                       # the cached blocks never returned features
        np.testing.assert_allclose(feats, _features(ids)[len(ids) - 1 - n:len(ids) - 1],
                                   atol=1e-4, rtol=1e-4)
    finally:
        engine.abort_request([s.request_id for s in seqs])
        engine.step()
    assert_no_leaks(llm)


@pytest.mark.slow
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_chunked_prefill_and_prefix_cache(preemption_mode):
    """A pool of 16 blocks for four sequences of up to 117 tokens (preemption), prompts in
    chunks of 32, and a second round that hits the prefix cache: greedy tokens equal the
    engine without speculation, every window drafted from is the target's features, no
    block or window left."""
    kw = dict(num_gpu_blocks_override=16, max_num_batched_tokens=32, max_model_len=200,
              preemption_mode=preemption_mode, swap_space=0.01)
    prompts = _prompts()[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=56, ignore_eos=True)
    want = _tokens(_llm(None, **kw), prompts, sp)
    spec = _llm("echo", 3, **kw)
    for _ in range(2):                                    # the second: prefix-cache hits
        outs, seen = _recorded_generate(spec, prompts, sp)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert len(seen) > 50
        _assert_windows_are_features(outs, seen)
    engine = spec.llm_engine
    assert sum(s.num_preemptions for s in engine.metrics.steps) > 0
    assert engine.metrics.spec_decode_num_draft_tokens > 0
    assert not engine.proposer._windows
    assert_no_leaks(spec)


def test_bad_heads_name_the_key(tmp_path):
    base = {"method": "eagle", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config.model.*no such file"):
        LLM("tiny", speculative_config={**base, "model": str(tmp_path / "none.safetensors")},
            **ENGINE)
    _, cfg = _target()
    wrong = {**eagle.flatten_head(_head("random"))}
    wrong["fc/kernel"] = np.zeros((2 * cfg.hidden_size, 8), np.float32)
    path = str(tmp_path / "wrong.safetensors")
    write_safetensors(path, wrong)
    with pytest.raises(ValueError, match="speculative_config.model.*fc/kernel"):
        LLM("tiny", speculative_config={**base, "model": path}, **ENGINE)
    del wrong["fc/bias"]
    write_safetensors(path, wrong)
    with pytest.raises(ValueError, match="speculative_config.model.*missing.*fc/bias"):
        LLM("tiny", speculative_config={**base, "model": path}, **ENGINE)
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM("tiny", speculative_config={"method": "eagle", "num_speculative_tokens": 2}, **ENGINE)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 host-platform devices")
def test_tensor_parallel_runs_the_head_replicated(tmp_path):
    """At TP = 2 (the target split, the head and the embedding it reads replicated): the
    tokens of the same run on one device, greedy ones equal to the run without speculation."""
    from hf_fixtures import make_hf_checkpoint
    from paxkv.model.weights import checkpoint_config
    from tp_helpers import TP_CONFIG, llm_kwargs, workload
    path = str(tmp_path / "ckpt")
    make_hf_checkpoint(path, seed=7, **{**TP_CONFIG, "tie_word_embeddings": True})
    head = str(tmp_path / "head.safetensors")
    write_safetensors(head, eagle.flatten_head(
        eagle.init_head(checkpoint_config(path), jax.random.PRNGKey(0))))
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    plain = workload(LLM(path, **llm_kwargs()), beams=False)
    want = workload(LLM(path, **llm_kwargs(speculative_config=spec)), beams=False)
    assert want["greedy"] == plain["greedy"] and want["again"] == plain["again"]
    llm = LLM(path, tensor_parallel_size=2, **llm_kwargs(speculative_config=spec))
    assert workload(llm, beams=False) == want
    assert llm.llm_engine.proposer.drafter.mesh is not None
    assert llm.llm_engine.metrics.spec_decode_num_draft_tokens > 50
    assert_no_leaks(llm)
