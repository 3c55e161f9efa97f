"""The API's errors in OpenAI's shape, and the checks of a request body's fields that
raise them (engine/pipeline/api.py and api_messages.py)."""

from __future__ import annotations

from aiohttp import web


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


def field(body: dict, name: str, kinds, default=None, *, allow_none=True):
    v = body.get(name, default)
    if v is None and allow_none:
        return default
    if isinstance(v, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ApiError(f"'{name}' has the wrong type", param=name, code="invalid_type")
    if not isinstance(v, kinds):
        raise ApiError(f"'{name}' has the wrong type", param=name, code="invalid_type")
    return v


def number(body: dict, name: str, default: float) -> float:
    """A float field: absent or null is the default; a whole number too large for a float
    is out of range (float() would raise), not a server error."""
    v = field(body, name, (int, float), default)
    try:
        return float(v)
    except OverflowError:
        raise ApiError(f"'{name}' is out of range", param=name, code="invalid_value") from None


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words (a client reads them, not Python's)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", int: "a number", float: "a number", list: "an array"}.get(type(value), "an object")
