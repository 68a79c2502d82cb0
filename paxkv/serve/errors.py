"""OpenAI's error body, and naming the field behind an engine ValueError.

`{"error": {"message", "type", "param", "code"}}` with the HTTP status; every 4xx names the
request field at fault in `param` where there is one.
"""
from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    """Raised by handlers; becomes an OpenAI error response."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 408: "invalid_request_error",
             413: "invalid_request_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def from_validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming its field (dotted path: messages.0.role)."""
    err = e.errors(include_url=False)[0]
    # Drop the union-member tags pydantic adds to the path (stop.str, stop.list[str]).
    loc = ".".join(str(p) for p in err.get("loc", ()) if not _is_type_tag(p))
    if err.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err.get('msg')}", None, "invalid_json")
    msg = err.get("msg", "invalid value")
    return APIError(400, f"{loc}: {msg}" if loc else msg, loc or None, "invalid_value")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)


def check_json_object(raw: bytes) -> None:
    """Reject a body that is valid JSON but not an object, before pydantic sees it."""
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:   # the parser's depth bound (about 1000 levels)
        raise APIError(400, "the body is nested too deeply", None, "invalid_json") from None
    if not isinstance(doc, dict):
        raise APIError(400, "the body must be a JSON object", None, "invalid_json")


_FIELD = re.compile(r"[a-z_]+")


def from_value_error(e: ValueError, renames: dict[str, str] | None = None,
                     default: str | None = None) -> APIError:
    """An engine / SamplingParams ValueError as a 400; its message starts with the field."""
    msg = str(e)
    m = _FIELD.match(msg)
    word = m.group(0) if m else None
    if word == "stop" or (word and msg.startswith("stop strings")):
        word = "stop"
    param = (renames or {}).get(word, word) if word else default
    if word and renames and word in renames:
        msg = renames[word] + msg[len(word):]
    return APIError(400, msg, param or default, "invalid_value")
