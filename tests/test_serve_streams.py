"""The engine process's wire without a server: frames, rows, updates (serve/ipc.py, streams.py)."""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import types

import pytest

from paxkv.assets import tiny_model_dir
from paxkv.outputs import CompletionOutput, RequestOutput
from paxkv.sampling_params import SamplingParams
from paxkv.serve.ipc import Channel, EngineState, FrameBuffer, frame
from paxkv.serve.metrics import ServerMetrics
from paxkv.serve.streams import OutputRows, RequestStream, SampleDelta, Update, step_engine
from paxkv.tokenizer import load_tokenizer
from serve_helpers import ROOT


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_model_dir())


def test_frames_survive_any_split():
    msgs = [("step", [(1, False, 3, 1, ((0, [5], None, None, None, None),), None)], EngineState(
        0, 0, 1, 0.25, 0, 0, 0, 2, 0.5), 0.01, 0.0, 0.0), [("abort", 7)], "x" * 70_000]
    data = b"".join(frame(m) for m in msgs)
    for piece in (1, 3, 4, 5, 1000, len(data)):
        buf, got = FrameBuffer(), []
        for at in range(0, len(data), piece):
            got += buf.feed(data[at:at + piece])
        assert got == msgs and not buf.pending, piece


def test_channel_receives_whole_frames_and_reports_eof():
    a, b = socket.socketpair()
    ours, theirs = Channel(a), Channel(b)
    big = list(range(300_000))   # larger than a socket buffer: arrives in pieces
    sender = threading.Thread(target=lambda: [theirs.send(("m", i, big)) for i in range(3)])
    sender.start()
    got = []
    while len(got) < 3:
        got += ours.receive(5.0)
    sender.join()
    assert [m[1] for m in got] == [0, 1, 2] and got[2][2] == big
    assert ours.receive(0.0) == []
    theirs.close()
    with pytest.raises(EOFError):
        ours.receive(5.0)


def _out(rid: str, ids: list[int], finished: bool, **kw) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(0, kw.pop("text", ""), ids, **kw)],
                         finished)


def test_rows_carry_only_new_tokens_and_updates_rebuild_the_text(tok):
    ids = tok.encode("It was a truth, universally acknowledged, that caf\u00e9s close early")
    rows = OutputRows()
    rows.track("a", 0, stream=True)
    rows.track("b", 1, stream=False)
    metrics = ServerMetrics("t")
    sinks = [asyncio.Queue(), asyncio.Queue()]
    streams = [RequestStream(SamplingParams(max_tokens=50), s, tok, sinks[i], 0.0, 3)
               for i, s in enumerate((True, False))]
    texts = ["", ""]
    n_updates = [0, 0]
    for k in range(1, len(ids) + 1):
        last = k == len(ids)
        step = rows.rows([_out("a", ids[:k], last, finish_reason="length" if last else None),
                          _out("b", ids[:k], last, finish_reason="length" if last else None),
                          _out("gone", ids[:k], False)])   # untracked: skipped
        assert [r[0] for r in step] == [0, 1]
        assert step[0][4][0][1] == ids[k - 1:k]            # the stream: one new token
        assert step[1][4] == (() if not last else step[1][4])  # the other: nothing until the end
        for r in step:
            u = streams[r[0]].apply(r, float(k), metrics)
            if u is not None:
                n_updates[r[0]] += 1
                texts[r[0]] += "".join(d.text for d in u.deltas)
    assert texts == [tok.decode(ids)] * 2
    assert n_updates[1] == 2   # its first token (admission) and its end
    assert not rows.forget("a") and not rows.forget("b")   # finished: no longer tracked


def test_stop_strings_hold_text_back_and_end_on_the_engine_text(tok):
    ids = tok.encode("She said yes, and then she left the room")
    stop = " then"
    rows = OutputRows()
    rows.track("a", 0, stream=True)
    rs = RequestStream(SamplingParams(max_tokens=50, stop=[stop]), True, tok, asyncio.Queue(), 0.0, 3)
    expected = tok.decode(ids)[:tok.decode(ids).index(stop)]
    streamed = ""
    for k in range(1, len(ids) + 1):   # the engine ends the request at the stop string's token
        text = tok.decode(ids[:k])
        last = stop in text
        cut = text[:text.index(stop)] if last else ""
        out = _out("a", ids[:k], last, text=cut, finish_reason="stop" if last else None,
                   stop_reason=stop if last else None)
        (row,) = rows.rows([out])
        u = rs.apply(row, 0.0, ServerMetrics("t"))
        streamed += "".join(d.text for d in u.deltas)
        assert expected.startswith(streamed)   # held back: never a character past the stop
        if last:
            break
    assert last and streamed == cut == expected == "She said yes, and"
    assert streamed == cut
    assert pickle.loads(pickle.dumps(row)) == row


def test_delta_rows_end_each_sample_when_it_ends(tok):
    """DELTA outputs (what a stream asks the engine for): each output holds only news, and a
    sample that a stop string ends before its sibling gets its end, text cut, at once."""
    ids = [tok.encode("It was a truth universally acknowledged"), tok.encode("She said no, then left")]
    stop = " then"
    cut = tok.decode(ids[1])[:tok.decode(ids[1]).index(stop)]
    ends_at = next(k for k in range(1, len(ids[1]) + 1) if stop in tok.decode(ids[1][:k]))
    rows = OutputRows()
    rows.track("a", 0, stream=True, delta=True)
    with pytest.raises(ValueError, match="DELTA outputs are for streamed requests"):
        rows.track("b", 1, stream=False, delta=True)
    rs = RequestStream(SamplingParams(n=2, max_tokens=50, stop=[stop]), True, tok, asyncio.Queue(), 0.0, 3)
    metrics = ServerMetrics("t")
    texts, finishes, total = ["", ""], [None, None], 0
    for k in range(1, len(ids[0]) + 1):
        comps = [CompletionOutput(0, "", ids[0][k - 1:k], finish_reason="length" if k == len(ids[0]) else None)]
        if k <= ends_at:
            done = k == ends_at
            comps.append(CompletionOutput(1, cut if done else "", ids[1][k - 1:k],
                                          finish_reason="stop" if done else None,
                                          stop_reason=stop if done else None))
        total += sum(len(c.token_ids) for c in comps)
        (row,) = rows.rows([RequestOutput("a", None, [1, 2, 3], comps, k == len(ids[0]))])
        assert row[3] == total                      # tokens of both samples so far
        u = rs.apply(row, float(k), metrics)
        for d in u.deltas:
            assert finishes[d.index] is None, "a sample spoke after its end"
            texts[d.index] += d.text
            finishes[d.index] = d.finish_reason
        assert finishes[1] == ("stop" if k >= ends_at else None)
        assert cut.startswith(texts[1])            # never a character of the stop string
    assert texts == [tok.decode(ids[0]), cut] and finishes == ["length", "stop"]


def test_step_engine_fails_what_is_in_flight_and_keeps_serving(caplog):
    class Engine:
        def __init__(self, error=None):
            self.error = error
            self.metrics = types.SimpleNamespace(steps=["a step's stats"])

        def step(self):
            if self.error:
                raise self.error
            return ["out"]

    failed = []
    log = logging.getLogger("paxkv.serve.test")
    good = Engine()
    outs, step_s = step_engine(good, failed.append, log)
    assert outs == ["out"] and step_s >= 0.0 and good.metrics.steps == [] and failed == []
    bad = Engine(RuntimeError("boom"))
    with caplog.at_level(logging.ERROR, logger="paxkv.serve.test"):
        assert step_engine(bad, failed.append, log) is None
    assert failed == ["engine step failed: boom"]
    assert "engine step failed" in caplog.text
    assert bad.metrics.steps == ["a step's stats"]   # nothing stepped, nothing dropped


def test_merged_updates_concatenate_per_choice():
    a = Update([SampleDelta(0, "ab", [1, 2], [{1: -1.0}, {2: -2.0}]), SampleDelta(1, "x", [9], None)],
               False, 3, 3)
    b = Update([SampleDelta(0, "c", [3], [{3: -3.0}], "length", None)], True, 3, 4)
    m = a.merged(b)
    assert m.finished and m.num_output_tokens == 4
    d0, d1 = sorted(m.deltas, key=lambda d: d.index)
    assert (d0.text, d0.token_ids, d0.finish_reason) == ("abc", [1, 2, 3], "length")
    assert d0.logprobs == [{1: -1.0}, {2: -2.0}, {3: -3.0}]
    assert (d1.text, d1.token_ids) == ("x", [9])
    err = Update([], True, 3, 4, "boom")
    assert a.merged(err) is err


def test_the_frontend_never_imports_jax():
    """The frontend must not claim the accelerator the engine process uses."""
    code = ("import sys, paxkv.serve.cli, paxkv.serve.app, paxkv.serve.engine_client; "
            "paxkv.serve.cli.build_parser(); assert 'jax' not in sys.modules, 'jax imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
