"""What the capacity scheduler's generic paths (capacity.py) and plain paths (capacity_plain.py)
share: its output, what a request state means to it (state kinds, per band), the budget constants
and the prefix-aware skipping helpers (reference 2.9).

Pure Python, stdlib only.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .kv_prefix_reuse import PrefixReuseSummary
from .request import LlmRequest, LlmRequestState

__all__ = ["CapacityOutput"]


class CapacityOutput(NamedTuple):
    fitting: list[LlmRequest]
    fitting_disagg_gen_init: list[LlmRequest]
    paused: list[LlmRequest]


# What a state means to the capacity scheduler, precomputed per band so that the hot loops do
# one dict lookup per request instead of a chain of state comparisons.
_SKIP = 0  # outside the band (or DISAGG_CONTEXT_WAIT_SCHEDULER inside an encoder band)
_RUNNING = 1  # generation-in-progress, in the band
_TRANSFER = 2  # DISAGG_GENERATION_TRANS_IN_PROGRESS: counted, never returned (band exempt)
_GEN_INIT = 3  # DISAGG_GENERATION_INIT: KV reserved so its transfer can start (band exempt)
_CONTEXT = 4  # context-init, in the band
_ENCODER = 5  # encoder-init, in the band: a slot and LoRA pages, no KV
_OTHER = 6  # any other state in the band: considered, never reserved for

_S = LlmRequestState
_GENERATION_IN_PROGRESS = (
    _S.DISAGG_GENERATION_TRANS_COMPLETE,
    _S.GENERATION_IN_PROGRESS,
    _S.GENERATION_TO_COMPLETE,
)
_CONTEXT_INIT = (_S.CONTEXT_INIT, _S.DISAGG_CONTEXT_INIT_AND_TRANS)


def _state_kinds(until: LlmRequestState, after: LlmRequestState) -> dict[LlmRequestState, int]:
    kinds: dict[LlmRequestState, int] = {}
    for state in LlmRequestState:
        if state == _S.DISAGG_GENERATION_TRANS_IN_PROGRESS:
            kind = _TRANSFER
        elif state == _S.DISAGG_GENERATION_INIT:
            kind = _GEN_INIT
        elif not until <= state < after or state == _S.DISAGG_CONTEXT_WAIT_SCHEDULER:
            # Python's scheduler rejects WAIT_SCHEDULER explicitly: an ENCODER_INIT band would
            # otherwise take in a context-only request still waiting for its generation side.
            kind = _SKIP
        elif state in _GENERATION_IN_PROGRESS:
            kind = _RUNNING
        elif state in _CONTEXT_INIT:
            kind = _CONTEXT
        elif state == _S.ENCODER_INIT:
            kind = _ENCODER
        else:
            kind = _OTHER
        kinds[state] = kind
    return kinds


_INT_MAX = 2**31 - 1  # PEFT budget without a PEFT manager (C++ INT_MAX)
# enable_prefix_aware_scheduling=False: first-chunk contexts get this, so there is no reuse credit.
_ZERO_SUMMARY = PrefixReuseSummary(0, 0, None)


def _beneficial_to_skip(
    summary: PrefixReuseSummary | None,
    cross_summary: PrefixReuseSummary | None,
    contributed: set[Any],
    cross_contributed: set[Any],
) -> bool:
    """Pure (registers nothing): an admitted or executing context will store this request's
    first uncached block, so waiting one round turns that block into a reuse hit."""
    if summary is not None:
        block = summary.first_new_block
        if block is not None and block in contributed:
            return True
    if cross_summary is not None:
        block = cross_summary.first_new_block
        if block is not None and block in cross_contributed:
            return True
    return False


def _register_contribution(
    summary: PrefixReuseSummary | None,
    cross_summary: PrefixReuseSummary | None,
    contributed: set[Any],
    cross_contributed: set[Any],
) -> None:
    """Called only once a request is admitted, so no later duplicate waits on a contributor that
    the budget checks rejected, and a MAX_UTILIZATION retry after a pause never sees its own
    block."""
    if summary is not None and summary.first_new_block is not None:
        contributed.add(summary.first_new_block)
    if cross_summary is not None and cross_summary.first_new_block is not None:
        cross_contributed.add(cross_summary.first_new_block)


def _reuse_walk_allowed(manager: Any) -> bool:
    return manager is not None and manager.enable_block_reuse and not manager.is_variable_window
