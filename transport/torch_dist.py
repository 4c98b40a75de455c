"""torch.distributed data plane of the KV transfer: one process group per (context worker,
generation worker) pair and one dedicated thread per pair on each side.

Every decision (leases, deadlines, quarantine, what to send) is ``protocol``'s; the data plane
moves bytes and reports back. It lives in these modules:
  ``kv_groups``    the pair process groups and what both sides share (``TransportConfig``,
                   ``layout_of``, op deadlines, staging ring, block mover, header tensor, the
                   client end of the rendezvous store), with the pair protocol and failure rule
  ``kv_sender``    context side: ``KVSender`` and its per-generation-worker pair threads
  ``layer_progress``  how far a layer-wise send may go (``LayerProgress``)
  ``kv_receiver``  generation side: ``KVReceiver``, one pair per context worker
  ``kv_receiver_pair``  one such pair's receive thread (``ReceiverPair``)
This module keeps the names the rest of pdserve imports from it.
"""
from __future__ import annotations

from .kv_groups import TransportConfig, layout_of
from .kv_receiver import KVReceiver
from .kv_sender import KVSender, SendHook

__all__ = ["KVReceiver", "KVSender", "SendHook", "TransportConfig", "layout_of"]
