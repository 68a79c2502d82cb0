"""What the engine process's wire costs per step: message size, and the time to build, send,
receive and turn into updates one engine step's frame of `--rows` changed requests.

Synthetic decode steps (each row: one new token of a streamed request, optionally its
logprobs), through the same code `paxkv serve` runs: `OutputRows.rows` (engine side),
`ipc.frame` and a socket pair to a second process that reads with `FrameBuffer`
(the frontend's parser), then `RequestStream.apply` (detokenization, the tiny model's
tokenizer). Writes engine_ipc.json and engine_ipc.md to --out_dir.

    PYTHONPATH=. python3 scripts/measure_engine_ipc.py --out_dir results
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 256, "changed requests per engine step")
flags.DEFINE_integer("steps", 256, "steps timed (request outputs grow by one token a step)")
flags.DEFINE_integer("logprobs", 0, "top logprobs per token (0: none)")
flags.DEFINE_string("out_dir", "scratch/results", "where engine_ipc.json / .md go (--out_dir=results updates the committed results)")


def _outputs(rows: int, step: int, logprobs: int) -> list:
    from paxkv.outputs import CompletionOutput, RequestOutput
    outs = []
    for r in range(rows):
        ids = [(r * 7 + k * 13) % 4000 + 10 for k in range(step + 1)]
        lps = ([{t: -0.5, **{t + j + 1: -1.0 - j for j in range(logprobs)}} for t in ids]
               if logprobs else None)
        outs.append(RequestOutput(str(r), None, list(range(256)),
                                  [CompletionOutput(0, "", ids, logprobs=lps)], False))
    return outs


def _reader(sock: socket.socket, n: int, conn) -> None:
    """The frontend's half: read n frames, answering one byte after each whole frame (so the
    sender times a round trip); report the time spent unpickling."""
    from paxkv.serve.ipc import FrameBuffer
    buf = FrameBuffer()
    got, busy = 0, 0.0
    conn.send("ready")
    while got < n:
        data = sock.recv(1 << 20)
        t0 = time.perf_counter()
        k = len(buf.feed(data))
        busy += time.perf_counter() - t0
        if k:
            sock.sendall(b"x" * k)
        got += k
    conn.send(busy)


def main(argv) -> None:
    del argv
    from paxkv.serve.ipc import EngineState, frame
    from paxkv.serve.metrics import ServerMetrics
    from paxkv.serve.streams import OutputRows, RequestStream
    from paxkv.sampling_params import SamplingParams
    from paxkv.tokenizer import load_tokenizer
    from paxkv.assets import tiny_model_dir

    rows_n, steps = FLAGS.rows, FLAGS.steps
    tracker = OutputRows()
    for r in range(rows_n):
        tracker.track(str(r), r, stream=True)
    state = EngineState(0, 0, rows_n, 0.5, 0, 0, 0, 7, 1.0)
    frames, all_rows = [], []
    t_rows, t_encode = [], []
    for s in range(steps):
        outs = _outputs(rows_n, s, FLAGS.logprobs)
        a = time.perf_counter()
        rows = tracker.rows(outs)
        b = time.perf_counter()
        frames.append(frame(("step", rows, state, 0.01, 0.001, 0.0)))
        t_rows.append(b - a)
        t_encode.append(time.perf_counter() - b)
        all_rows.append(rows)
    sizes = [len(f) for f in frames]
    # the wire: a second process reads and parses
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = socket.socketpair()
    parent_conn, child_conn = ctx.Pipe()
    reader = ctx.Process(target=_reader, args=(theirs, steps, child_conn))
    reader.start()
    assert parent_conn.recv() == "ready"   # its start-up is not the wire's cost
    t_wire = []
    for f in frames:   # one step's frame at a time, as the engine sends them
        t0 = time.perf_counter()
        mine.sendall(f)
        mine.recv(1)
        t_wire.append(time.perf_counter() - t0)
    parse_busy = parent_conn.recv()
    reader.join()
    # frontend side: rows -> updates (incremental detokenization of one token per row)
    tok = load_tokenizer(tiny_model_dir())
    metrics = ServerMetrics("tiny")
    sink: asyncio.Queue = asyncio.Queue()
    streams = [RequestStream(SamplingParams(max_tokens=10**6), True, tok, sink, 0.0, 256)
               for _ in range(rows_n)]
    t_apply = []
    for rows in all_rows:
        t0 = time.perf_counter()
        for row in rows:
            streams[row[0]].apply(row, 1.0, metrics)
        t_apply.append(time.perf_counter() - t0)
    per = lambda x: 1e6 * x / steps  # noqa: E731 - microseconds per step
    med = lambda xs: 1e6 * statistics.median(xs)  # noqa: E731 - microseconds, median step
    result = {
        "rows": rows_n, "steps": steps, "logprobs": FLAGS.logprobs,
        "frame_bytes_mean": sum(sizes) / len(sizes), "frame_bytes_max": max(sizes),
        "engine_rows_us": med(t_rows), "engine_pickle_us": med(t_encode), "wire_round_trip_us": med(t_wire),
        "frontend_parse_us": per(parse_busy), "frontend_apply_us": med(t_apply),
        "load_average": os.getloadavg()[0],
        "python": sys.version.split()[0], "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "command": " ".join(["python3", *sys.argv]),
    }
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    with open(os.path.join(FLAGS.out_dir, "engine_ipc.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = [f"# The engine process's wire, per engine step of {rows_n} changed requests", "",
          f"Command: `{result['command']}` (Python {result['python']}, {result['machine']}, "
          f"load average {result['load_average']:.1f})", "",
          "| frame bytes (mean / max) | engine: rows | engine: pickle | send -> received, parsed, "
          "acknowledged | frontend: unpickle "
          "| frontend: rows -> updates (detokenization) |", "| --- | --- | --- | --- | --- | --- |",
          f"| {result['frame_bytes_mean']:.0f} / {result['frame_bytes_max']} | "
          f"{result['engine_rows_us']:.0f} us | {result['engine_pickle_us']:.0f} us | "
          f"{result['wire_round_trip_us']:.0f} us | {result['frontend_parse_us']:.0f} us | "
          f"{result['frontend_apply_us']:.0f} us |", "",
          "Each row is one new token of a streamed request (a decode step). Medians over the "
          "steps, except unpickle (the mean). The round trip sends one step's frame through a "
          "socket pair to a second process, which parses it and answers one byte: an upper "
          "bound on the wire's latency (the engine itself only waits for `sendall`). "
          "Engine-side cost per step: rows + pickle + sendall; the frontend's: unpickle + "
          "updates, on its own core."]
    with open(os.path.join(FLAGS.out_dir, "engine_ipc.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    app.run(main)
