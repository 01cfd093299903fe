"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_value_error(exc: ValueError, default_param: str | None = None) -> APIError:
    """batchrun's ValueErrors start with the field name ("max_tokens: must be ..."): keep it as the param."""
    message = str(exc)
    head = message.split(":", 1)[0]
    param = head if head and " " not in head and len(head) < 40 else default_param
    return bad_request(message, param)
