"""`ApiError`: a request `specx serve` refuses, with the OpenAI-style error body and status it is sent as.

Raised by request validation (requests.py), prompt tokenization (tokens.py) and the HTTP
routes (app.py); its own module so that none of them has to import another for it.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from ..core.serve.events import Failed


class ApiError(Exception):
    """A request the API refuses, as OpenAI reports it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after: int = 1) -> None:
        # what a failure's text holds (a lone surrogate from the request) must not stop its own answer
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after  # seconds, said with a 429 or 503

    @classmethod
    def from_failure(cls, failed: Failed) -> ApiError:
        """The worker's Failed: below 500 the request's fault (an invalid value when it names a parameter)."""
        if failed.status < 500:
            return cls(failed.status, failed.message, failed.param, "invalid_value" if failed.param else None)
        return cls(failed.status, failed.message, failed.param, None, "server_error")

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.status in (429, 503) else None
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)
