"""The engine process of `paxkv serve` (vLLM V1's EngineCore): `LLM` and a busy step loop.

Started by the frontend (`engine_client.py`) as `python3 -m paxkv.serve.engine_core --fd N`
with one end of a socket pair; the first frame on it is the LLM's arguments. The process
loads the model, answers ("ready", EngineInfo), then loops: apply every command that
arrived (add, abort, shutdown; waiting for one only when nothing runs), run one
`engine.step()`, send one ("step", rows, EngineState, timings) frame with every changed
request's new tokens. Requests arrive checked and tokenized: the engine queues them
without checking again. No HTTP, no detokenization here, except the stop-string check
the engine's output processor makes as it does for `LLM.generate`.

It ends on a shutdown command, or when the frontend's end of the socket closes (the
frontend died: no orphan keeps the device; on Linux the frontend's death also sends it
SIGTERM, so a model load or a long step cannot outlive it). SIGINT is ignored: Ctrl-C in a terminal reaches
the whole process group, and the frontend decides how the engine stops.

Host code apart from the LLM it builds; see ipc.py for the wire format.
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from typing import Any, Sequence

from paxkv.engine.llm_engine import Intake
from paxkv.sampling_params import RequestOutputKind
from paxkv.serve.ipc import Channel, EngineInfo, EngineState
from paxkv.serve.streams import OutputRows, step_engine

logger = logging.getLogger("paxkv.serve.engine")

# An idle engine still reports its idle time this often, so /metrics stays current.
_IDLE_REPORT_S = 1.0


def build_llm(config: dict[str, Any]) -> Any:
    from paxkv.llm import LLM
    engine_args = dict(config["engine_args"])
    if config.get("tokenizer") is not None:
        from paxkv.tokenizer import load_tokenizer
        engine_args["tokenizer"] = load_tokenizer(config["tokenizer"])
    return LLM(config["model"], **engine_args)


class EngineCore:
    """The loop; see the module docstring."""

    def __init__(self, llm: Any, channel: Channel) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.channel = channel
        self.rows = OutputRows()
        self.idle_s = 0.0

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            t0 = time.perf_counter()
            try:
                msgs = self.channel.receive(0.0 if busy else _IDLE_REPORT_S)
            except EOFError:
                logger.warning("the frontend has gone; the engine process ends")
                return
            if not busy:
                self.idle_s += time.perf_counter() - t0
            for cmds in msgs:
                for cmd in cmds:
                    if cmd[0] == "shutdown":
                        return
                    self._apply(cmd)
            if not engine.has_unfinished_requests():
                if msgs or self.idle_s >= _IDLE_REPORT_S:   # aborts emptied it: say so
                    self._send_step([], 0.0, 0.0)
                continue
            stepped = step_engine(engine, self._fail_all, logger)
            if stepped is None:
                continue
            outs, step_s = stepped
            t2 = time.perf_counter()
            rows = self.rows.rows(outs)
            self._send_step(rows, step_s, time.perf_counter() - t2)

    def _apply(self, cmd: tuple) -> None:
        engine = self.engine
        if cmd[0] == "abort":
            rid = str(cmd[1])
            if self.rows.forget(rid):
                engine.abort_request(rid)
            return
        _, key, ids, params, stream = cmd
        rid = str(key)
        try:   # the frontend ran every check already (its validator is built from EngineInfo)
            engine.enqueue(Intake(rid, None, ids, params, engine.features.prepare(params, ids, None)))
        except ValueError as e:
            self.channel.send(("failed", [key], str(e)))
            return
        self.rows.track(rid, key, stream, params.output_kind is RequestOutputKind.DELTA)

    def _send_step(self, rows: list, step_s: float, process_s: float) -> None:
        self.channel.send(("step", rows, EngineState.of(self.engine), step_s, process_s, self.idle_s))
        self.idle_s = 0.0

    def _fail_all(self, message: str) -> None:
        self.channel.send(("failed", self.rows.abort_all(self.engine), message))


def _end_with_parent() -> None:
    """Linux: SIGTERM this process when the frontend dies, even while it loads the model or
    runs a long step and so reads no socket (elsewhere the closed socket alone ends it)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paxkv.serve.engine_core",
                                     description="The engine process of `paxkv serve`.")
    parser.add_argument("--fd", type=int, required=True, help="this end of the frontend's socket pair")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    channel = Channel(socket.socket(fileno=args.fd))
    try:
        config = channel.receive_one()
    except EOFError:
        return 1
    try:
        llm = build_llm(config)
    except ValueError as e:   # a bad engine argument: the frontend makes it a usage error
        channel.send(("error", str(e)))
        return 2
    try:
        channel.send(("ready", EngineInfo.of(llm)))
        EngineCore(llm, channel).run()
    except (BrokenPipeError, ConnectionResetError, EOFError):
        logger.warning("the frontend has gone; the engine process ends")
    finally:
        channel.close()
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
