"""omni-ray's errors: the caller's fault (4xx) or the engine's (5xx).

Every layer raises these; the HTTP layer maps them to OpenAI-style error bodies.
"""

from __future__ import annotations

import enum


class StageCall(enum.Enum):
    """The calls a request makes of the stages; a lost one is named by it and issued again."""

    ENCODE_PROMPT = "encode_prompt"
    ENCODE_IMAGE = "encode_image"
    DENOISE = "denoise"
    DECODE = "decode"
    CHECK_LORA = "check_lora"
    CAPTION = "caption"  # Qwen-Image-Layered: the encoder captions an image for an empty prompt


class OmniRayError(Exception):
    """Base of every error omni-ray raises on purpose."""

    status_code = 500
    error_type = "server_error"

    def __reduce__(self):
        # Errors cross Ray's process boundaries. Exception's own pickling calls cls(*args), which does not fit
        # constructors that take other arguments than the message; this restores the same fields instead.
        return _restore, (type(self), self.args, self.__dict__)


def _restore(cls: type[OmniRayError], args: tuple, state: dict) -> OmniRayError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class RequestError(OmniRayError):
    """The request is invalid: a parameter out of range, a modality the preset does not support."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NotFoundError(RequestError):
    """The request names something this app does not have: a model or LoRA adapter (OpenAI answers 404 with code
    ``model_not_found``)."""

    status_code = 404

    def __init__(self, message: str, param: str | None = None, code: str | None = "model_not_found"):
        super().__init__(message, param)
        self.code = code


class AuthenticationError(RequestError):
    """The request has no API key, or not one of the server's (OpenAI answers 401 with code ``invalid_api_key``)."""

    status_code = 401

    def __init__(self, message: str):
        super().__init__(message, param=None)
        self.code = "invalid_api_key"


class ForbiddenError(RequestError):
    """The server does not allow what the request asks (an admin route the preset keeps off)."""

    status_code = 403


class RateLimitError(RequestError):
    """The request's API key is over one of its quotas (``omni_ray.quotas``): a 429 with OpenAI's code
    ``rate_limit_exceeded`` and its type, ``requests`` or ``tokens``; retry after ``retry_after_s``."""

    status_code = 429

    def __init__(self, message: str, error_type: str = "requests", retry_after_s: float = 1.0):
        super().__init__(message, param=None)
        self.error_type = error_type
        self.code = "rate_limit_exceeded"
        self.retry_after_s = retry_after_s


class PayloadTooLargeError(RequestError):
    """The request body is larger than the API accepts."""

    status_code = 413


class EngineError(OmniRayError):
    """A stage failed while running a request: the model, memory, or the engine loop."""

    def __init__(self, message: str, stage: str | None = None):
        super().__init__(message)
        self.message = message
        self.stage = stage  # set by the engine that ran the request when the raiser did not know it

    def __str__(self) -> str:
        return f"{self.stage}: {self.message}" if self.stage else self.message


class RefusedError(EngineError):
    """A stage refused a request before running it: an input its model does not take (an RGB image for an RGBA VAE,
    say). The request's fault, so a 400; it fails alone."""

    status_code = 400
    error_type = "invalid_request_error"


class OverloadedError(EngineError):
    """A stage cannot take the request now (its queue is full, its memory ran out, its replica is gone and retries
    ran out): retry after ``retry_after_s``."""

    status_code = 503
    error_type = "overloaded_error"

    def __init__(self, message: str, retry_after_s: float = 1.0, stage: str | None = None):
        super().__init__(message, stage)
        self.retry_after_s = retry_after_s


class StageLostError(OverloadedError):
    """A stage call was lost with its replica (or the object it returned was lost with its node). Stage calls are
    deterministic in their inputs, so the request path issues ``call`` again; the caller sees this error only when
    the request's retry budget runs out."""

    def __init__(self, stage: str, call: StageCall, cause: str = "", retry_after_s: float = 5.0):
        detail = f": {cause}" if cause else ""
        super().__init__(f"the replica running {call.value} was lost{detail}", retry_after_s, stage)
        self.call = call


class GangError(EngineError):
    """A stage's gang (one DiT or VAE replica's ranks, ``omni_ray.engine.executor``) broke: a rank died, or a call
    to the ranks ran past its timeout. The ranks' states may have diverged, so the gang runs nothing more; its
    executor's ``check_health`` raises from then on."""


class DeadlineExceededError(EngineError):
    """The request ran past its deadline; its work was aborted in every stage."""

    status_code = 504
    error_type = "timeout_error"


def request_failure(err: Exception) -> EngineError:
    """What a model runner's exception means for the one request it concerns: running out of device memory is
    a 503 (the request may fit later, or on another replica); anything else is a 500 naming the exception."""
    if isinstance(err, EngineError):
        return err
    # torch.OutOfMemoryError (CUDA) and MemoryError (host); matched by name so that this module needs no torch.
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return OverloadedError(f"out of memory while running the request: {err}", retry_after_s=5.0)
    return EngineError(f"{type(err).__name__}: {err}")
