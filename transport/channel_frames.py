"""Frames of the router -> worker request channel (see ``workers/request_channel.py``). PURE
(stdlib + msgpack), so the router imports it without torch.

msgpack maps, back to back on a TCP stream; ``frame_unpacker`` splits the stream into frames
and bounds what one frame may buffer.
"""
from __future__ import annotations

from typing import Any

import msgpack

MAX_FRAME_BYTES = 64 << 20  # a prompt of millions of tokens still fits; a garbage length does not


def pack_frame(frame: dict[str, Any]) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


def frame_unpacker() -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME_BYTES)
