"""The router core's errors. The core knows no protocol: a refused or failed request carries a
``RouterErrorKind``, and each front door maps the kind to its own status (gRPC status codes in
``cluster/front/grpc/convert.py``, HTTP statuses in ``cluster/front/openai/server.py``)."""
from __future__ import annotations

import enum
from typing import NamedTuple


class RouterErrorKind(enum.Enum):
    """Why a request was refused or ended without a finish reason. The names follow gRPC's status
    codes, which every door can express."""

    INVALID_ARGUMENT = "invalid_argument"  # a field is wrong (``RouterError.field`` names it)
    ALREADY_EXISTS = "already_exists"  # the request id is in flight already
    RESOURCE_EXHAUSTED = "resource_exhausted"  # the queue is full
    UNAVAILABLE = "unavailable"  # no worker can serve it, or the router is stopping
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the request's deadline passed
    INTERNAL = "internal"  # a router bug, confined to this request


class RouterError(Exception):
    """A request refused at admission or ended by an error. For an error in one request field,
    ``field`` names it (a ``GenerateSpec`` path such as ``sampling.top_p``) and ``detail`` says
    what is wrong with it; ``message`` is then "<field>: <detail>"."""

    def __init__(self, kind: RouterErrorKind, message: str, field: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.field = kind, message, field
        self.detail = detail if detail is not None else message


class Failure(NamedTuple):
    """Put on a request's output queue: ``Router.results`` raises it as a RouterError."""

    kind: RouterErrorKind
    message: str


class WorkerFailure(RuntimeError):
    """A worker attempt failed (its channel closed, it went silent, or the transfer failed):
    the request may be retried on other workers."""


class WorkerDown(WorkerFailure):
    """The worker said it takes no more requests (its step loop died: it exits and Ray
    restarts it): it is unhealthy from now until its next incarnation connects."""

    def __init__(self, message: str, worker_id: str) -> None:
        super().__init__(message)
        self.worker_id = worker_id


class TransferFailed(WorkerFailure):
    """The generation worker is alive but the request's KV did not arrive: a fallback (local
    prefill, or another context worker), which does not use up max_retries."""


class RequestRejected(ValueError):
    """A worker refused the request itself (validation); retrying elsewhere cannot help."""


class DeadlineExceeded(RuntimeError):
    """A worker ended the attempt at the request's deadline."""


class StopStringReached(Exception):
    """Raised out of ``emit`` when the text hit a stop string: the request is complete and its
    attempts were aborted; the attempt loop ends quietly."""
