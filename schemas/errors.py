"""Error codes and the exception classes that carry them.

Every error that can reach a client has a stable ``ErrorCode`` and an HTTP
status. Each class says whether it is retryable: a retryable error is naked
and redelivered (up to ``max_deliver``); a non-retryable one terminates the
message at once, sends an error chunk and records the request as dead.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class ErrorCode(enum.StrEnum):
    INVALID_REQUEST = "invalid_request"
    INVALID_MEDIA = "invalid_media"
    MEDIA_FETCH_FAILED = "media_fetch_failed"
    URL_NOT_ALLOWED = "url_not_allowed"
    UNSUPPORTED_MEDIA = "unsupported_media"
    TOO_LARGE = "too_large"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNAUTHORIZED = "unauthorized"
    OVERLOADED = "overloaded"
    CANCELLED = "cancelled"
    NO_WORKERS = "no_workers"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal_error"


class MmpipeError(Exception):
    """Root of every mmpipe error. Not retryable unless a subclass says so."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(MmpipeError):
    """Malformed or inconsistent request. Not retryable."""

    code = ErrorCode.INVALID_REQUEST
    http_status = 400


class InvalidMedia(MmpipeError):
    """Media that cannot be decoded (corrupt, truncated, bad base64). Not retryable."""

    code = ErrorCode.INVALID_MEDIA
    http_status = 400


class UrlNotAllowed(MmpipeError):
    """A media URL that the URL policy forbids (scheme, internal address). Not retryable."""

    code = ErrorCode.URL_NOT_ALLOWED
    http_status = 400


class MediaFetchFailed(MmpipeError):
    """A media URL that could not be fetched (HTTP error, timeout, DNS). Not retryable:
    the client gave the URL and must fix it."""

    code = ErrorCode.MEDIA_FETCH_FAILED
    http_status = 400


class UnsupportedMedia(MmpipeError):
    """A media type or format the deployment does not take. Not retryable."""

    code = ErrorCode.UNSUPPORTED_MEDIA
    http_status = 422


class TooLarge(MmpipeError):
    """Over a byte, pixel or count cap. Not retryable."""

    code = ErrorCode.TOO_LARGE
    http_status = 413


class ContextLengthExceeded(MmpipeError):
    """Prompt plus max_tokens beyond the model's context. Not retryable."""

    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED
    http_status = 400


class RouteNotFound(MmpipeError):
    """An HTTP path the bridge does not serve. Not retryable."""

    code = ErrorCode.NOT_FOUND
    http_status = 404


class ImageNotFound(MmpipeError):
    """An image URL never given, or past its time. Not retryable."""

    code = ErrorCode.NOT_FOUND
    http_status = 404


class MethodNotAllowed(MmpipeError):
    """A path the bridge serves, asked with a method it does not take. Not retryable."""

    code = ErrorCode.METHOD_NOT_ALLOWED
    http_status = 405


class ModelNotFound(MmpipeError):
    """The requested model is not served here. Not retryable."""

    code = ErrorCode.MODEL_NOT_FOUND
    http_status = 404


class Unauthorized(MmpipeError):
    """Missing or wrong API key. Not retryable."""

    code = ErrorCode.UNAUTHORIZED
    http_status = 401


class Overloaded(MmpipeError):
    """A bounded queue is full. Retryable by the client after Retry-After."""

    code = ErrorCode.OVERLOADED
    http_status = 429
    retryable = True


class Cancelled(MmpipeError):
    """The client went away or cancelled. Not retryable."""

    code = ErrorCode.CANCELLED
    http_status = 499


class NoWorkers(MmpipeError):
    """No live consumer for a hop of the route. Retryable."""

    code = ErrorCode.NO_WORKERS
    http_status = 503
    retryable = True


class DeadlineExceeded(MmpipeError):
    """The request's deadline passed before it finished. Not retryable."""

    code = ErrorCode.DEADLINE_EXCEEDED
    http_status = 504


class TransientError(MmpipeError):
    """A failure that another attempt may not hit (a peer gone, a full inner
    queue, a lost tensor). Retryable."""

    code = ErrorCode.INTERNAL
    http_status = 503
    retryable = True


class InternalError(MmpipeError):
    """A bug or an unexpected failure inside a stage. Retryable: the message
    goes back to the queue until ``max_deliver`` is reached."""

    code = ErrorCode.INTERNAL
    http_status = 500
    retryable = True


class TensorGone(MmpipeError):
    """The referenced tensors cannot be read any more: the holder died, or it
    already freed them (read, released, expired). Retryable: the stage restarts
    the request from its first hop, which makes them again."""

    code = ErrorCode.INTERNAL
    http_status = 503
    retryable = True


class TargetTainted(TensorGone):
    """A READ into the caller's own tensors (a transport's ``get_into``)
    failed and could not be cancelled: they may still be written, so they
    must not be reused."""
