"""What bounds one client's claim on the server: body size, read time, JSON depth.

A request is read under two limits before any handler work: its body may hold at most
`max_body_bytes` (413 otherwise, refused from `Content-Length` before reading when the client
declares it), and its headers, then its body, must arrive within `read_timeout` seconds each
(a connection that sends no complete headers in time is closed; a body that stalls gets 408).
JSON nesting is bounded by the parser's recursion limit (a 400, never a RecursionError).
Everything here is host code; the defaults are documented in README's "Security and limits".
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import Request

from paxkv.serve.errors import APIError

MIN_BODY_BYTES = 1 << 20     # the body bound never goes below 1 MiB
BODY_BYTES_PER_TOKEN = 32    # JSON token ids take <= 8 bytes, text ~4 a token; 32 leaves room


def default_max_body_bytes(max_model_len: int) -> int:
    """32 bytes per token of the context, at least 1 MiB: a prompt that fits the model fits."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = MIN_BODY_BYTES
    read_timeout: float = 30.0    # seconds for the headers, then again for the body


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-request-body-bytes)",
                    None, "request_too_large")


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The body, refused (413) as soon as it is known to exceed the bound, and given up on
    (408) when the client has not sent it all within the read timeout."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise _too_large(limits.max_body_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.read_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise _too_large(limits.max_body_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.read_timeout:g} s",
                       None, "request_timeout") from None
    return b"".join(chunks)


def with_header_timeout(protocol: type, timeout: float) -> type:
    """A subclass of uvicorn's HTTP protocol class (`h11` or `httptools`) that closes a
    connection whose request headers are not complete `timeout` seconds after the connection
    opened, or after the first byte of a later request on it arrived (a kept-alive connection
    idling between requests is uvicorn's `timeout_keep_alive`'s business). Both classes create
    `self.cycle` once a request's headers are complete."""

    class HeaderTimeoutProtocol(protocol):   # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._awaited_after = self.cycle   # the request before the one being awaited
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            timer, self._header_timer = self._header_timer, None
            if timer is not None:
                timer.cancel()

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is self._awaited_after and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.cycle is self._awaited_after:
                self._arm_header_timer()   # the first bytes of the next request
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._awaited_after:
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            self._awaited_after = self.cycle
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{protocol.__name__}"
    return HeaderTimeoutProtocol
