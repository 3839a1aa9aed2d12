"""Errors as the OpenAI API returns them: an HTTP status and
``{"error": {"message", "type", "param", "code"}}``, so that its clients raise their own
exception classes (``BadRequestError``, ``NotFoundError``…) with our message."""

from __future__ import annotations

from typing import Any

from archc.errors import ArchcError

# status → the `type` OpenAI gives errors of that status
TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error",
         500: "server_error", 503: "server_error"}


class APIError(ArchcError):
    """A request the server refuses or cannot answer: its status, message, the request field at
    fault (`param`) and a machine-readable `code`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        """The JSON body of the response."""
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


def bad_field(param: str, message: str, code: str = "invalid_value") -> APIError:
    """A 400 naming the request field `param` that is wrong."""
    return APIError(400, f"{param}: {message}", param=param, code=code)
