"""LazyTensor (workers/model/weights.py): a region of a safetensors tensor, read alone, with the
stored dtype and shape known before any read."""
from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve.workers.model.weights import LazyTensor, materialize


def test_regions_read_what_slicing_the_whole_tensor_gives(tmp_path):
    whole = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5).to(torch.bfloat16)
    save_file({"w": whole}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt", device="cpu") as f:
        lazy = LazyTensor.of(f.get_slice("w"))
        assert lazy.dtype == torch.bfloat16 and lazy.shape == (4, 6, 5) and lazy.dim() == 3
        assert torch.equal(materialize(lazy), whole)
        assert torch.equal(lazy.narrow(1, 2, 3).load(), whole[:, 2:5])
        assert torch.equal(lazy[1].narrow(1, 1, 2).load(), whole[1, :, 1:3])  # select, then narrow
        gate, up = lazy[3].chunk(2, dim=0)
        assert torch.equal(up.load(), whole[3, 3:]) and gate.shape == (3, 5)
