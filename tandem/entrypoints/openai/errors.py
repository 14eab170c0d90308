"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every refusal the server makes goes through ``APIError`` (or is converted to one), so a
client always gets the same body shape whatever went wrong: malformed JSON, an unknown
model, a prompt too long, a missing API key, a body too large, or a dead engine.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Any, Optional

from pydantic import ValidationError
from starlette.responses import JSONResponse

# OpenAI's error "type" per status (what its own API sends).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param, code)


def _location(loc: tuple[Any, ...]) -> str:
    """``('messages', 0, 'role')`` -> ``messages[0].role``; union branch names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or str(part) in ("str", "int", "float", "bool"):
            continue  # a union member's name, e.g. 'list[int]'
        else:
            out += f".{part}" if out else str(part)
    return out


def from_validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, as one sentence naming the field."""
    err = e.errors(include_url=False)[0]
    loc = tuple(err["loc"])
    param = _location(loc) or None
    if err["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if err["type"] == "missing":
        return bad_request(f"'{param}' is a required property", param)
    msg = err["msg"]
    if err["type"] == "value_error":
        msg = str((err.get("ctx") or {}).get("error", msg))
        return bad_request(msg, param)
    return bad_request(f"{param}: {msg}" if param else msg, param)
