"""KV transfer between context and generation workers.

``protocol`` (pure) holds descriptors, control messages and the session state machines and is
imported eagerly; the torch data plane (``KVSender``, ``KVReceiver``, ``TransportConfig``) is
loaded on first access, so importing the protocol never pulls in torch.
"""
from __future__ import annotations

from typing import Any

from .protocol import (
    CancelTransfer, KVLayout, KVRequest, ProtocolError, ReceiverSessions, RecvState,
    SenderSessions, SendState, SessionStats, TransferDescriptor, TransferDone, TransferLog,
    TransferRecord, TransferRejected, TransferResult, TransitionError, decode_message,
    encode_message,
)

_LAZY = {"KVSender", "KVReceiver", "TransportConfig", "layout_of"}

__all__ = [
    "CancelTransfer", "KVLayout", "KVRequest", "ProtocolError", "ReceiverSessions", "RecvState",
    "SenderSessions", "SendState", "SessionStats", "TransferDescriptor", "TransferDone",
    "TransferLog", "TransferRecord", "TransferRejected", "TransferResult", "TransitionError",
    "decode_message", "encode_message", *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import torch_dist

        return getattr(torch_dist, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
