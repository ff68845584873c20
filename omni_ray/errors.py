"""omni-ray's errors: the caller's fault (4xx) or the engine's (5xx).

Every layer raises these; the HTTP layer maps them to OpenAI-style error bodies.
"""

from __future__ import annotations


class OmniRayError(Exception):
    """Base of every error omni-ray raises on purpose."""

    status_code = 500
    error_type = "server_error"


class RequestError(OmniRayError):
    """The request is invalid: a parameter out of range, a modality the preset does not support."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PayloadTooLargeError(RequestError):
    """The request body is larger than the API accepts."""

    status_code = 413


class EngineError(OmniRayError):
    """A stage failed while running a request: the model, memory, or the engine loop."""

    def __init__(self, message: str, stage: str | None = None):
        super().__init__(f"{stage}: {message}" if stage else message)
        self.stage = stage


class OverloadedError(EngineError):
    """A stage's queue is full, or a stage replica is gone and being replaced: retry after ``retry_after_s``."""

    status_code = 503
    error_type = "overloaded_error"

    def __init__(self, message: str, retry_after_s: float = 1.0, stage: str | None = None):
        super().__init__(message, stage)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(EngineError):
    """The request ran past its deadline; its work was aborted in every stage."""

    status_code = 504
    error_type = "timeout_error"
