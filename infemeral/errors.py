"""Errors that carry the gRPC status a user should see.

Everything the server refuses is raised as a `StatusError` somewhere below the
service layer; the service turns it into a gRPC status with the same message,
and the client turns that status back into a `StatusError`. The messages name
the problem and what to do about it, and never contain keys or payloads.
"""

from __future__ import annotations

import grpc


class InfemeralError(Exception):
    """Base class of every error this package raises on purpose."""


class UsageError(InfemeralError):
    """A flag, setting or argument the user has to change; the command line exits with status 2."""


class StatusError(InfemeralError):
    """An error with the gRPC status code it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0])


class InvalidArgument(StatusError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(StatusError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(StatusError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(StatusError):
    code = grpc.StatusCode.NOT_FOUND


class Aborted(StatusError):
    code = grpc.StatusCode.ABORTED


class AlreadyExists(StatusError):
    code = grpc.StatusCode.ALREADY_EXISTS


class DataLoss(StatusError):
    code = grpc.StatusCode.DATA_LOSS


class OutOfRange(StatusError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unavailable(StatusError):
    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(StatusError):
    """A limit was reached; `retry_after` (seconds) goes to the client as `retry-after-ms` metadata."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, code: grpc.StatusCode | None = None, *, retry_after: float = 1.0):
        super().__init__(message, code)
        self.retry_after = retry_after


class DeadlineExceeded(StatusError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnsupportedModel(InfemeralError):
    """The model's architecture cannot be split exactly (e.g. sandwich norms)."""


class NoChatTemplate(InfemeralError):
    """Chat was asked of a model whose tokenizer has no chat template (a base model)."""

    def __init__(self):
        super().__init__("this model has no chat template, so it cannot chat; use raw completion instead "
                         "(`infemeral-client generate --raw`, `Session.complete`, or /v1/completions)")


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, FailedPrecondition, PermissionDenied,
                                     NotFound, AlreadyExists, Aborted, DataLoss, OutOfRange, Unavailable,
                                     ResourceExhausted, DeadlineExceeded)}


def from_rpc_error(err: grpc.RpcError) -> StatusError:
    """Turn a gRPC error received by the client into the matching StatusError."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, StatusError)
    return cls(f"{details} [{code.name}]", code)
