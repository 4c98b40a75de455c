"""KV transfer between context and generation workers.

``protocol`` (descriptors, control messages, wire header, chunk planning), ``sessions`` and
``session_sides`` (the session state machines) and ``requests/`` (the router <-> worker request
channel) are pure and imported eagerly; the torch data plane (``KVSender``, ``KVReceiver``, ``TransportConfig``) is
loaded on first access, so importing the protocol never pulls in torch.
"""
from __future__ import annotations

from typing import Any

from .protocol import (
    CancelTransfer, HeadSlice, KVLayout, KVRequest, ProtocolError, TransferDescriptor,
    TransferDone, TransferRejected, decode_message, encode_message,
)
from .session_sides import ReceiverSessions, SenderSessions
from .sessions import (
    RecvState, SendState, SessionStats, TransferLog, TransferRecord, TransferResult,
    TransitionError,
)

_LAZY = {"KVSender", "KVReceiver", "TransportConfig", "layout_of"}

__all__ = [
    "CancelTransfer", "HeadSlice", "KVLayout", "KVRequest", "ProtocolError", "ReceiverSessions",
    "RecvState", "SenderSessions", "SendState", "SessionStats", "TransferDescriptor",
    "TransferDone", "TransferLog", "TransferRecord", "TransferRejected", "TransferResult",
    "TransitionError",
    "decode_message", "encode_message", *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import torch_dist

        return getattr(torch_dist, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
