"""``layers.linear`` on oneDNN-prepacked weights: inputs under ``MIN_PACKED_ROWS`` rows run as
that many rows (zero-padded), which is faster on this kind of CPU and makes a row's result
independent of how many rows share the GEMM.

oneDNN's 1-row fp32 kernel sums K in another order than its batched kernels when K is not a
multiple of its block (1408 and 2816 here, the down projections of vs_vllm's models), so
without the padding a decode step of one sequence gave slightly different logits than the same
sequence batched with others.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.workers.model import layers

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")

SHAPES = [(512, 1408), (1024, 2816), (1536, 1024), (4096, 512)]  # [N, K]
DTYPES = [torch.float32] + (
    [torch.bfloat16] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_rows_result_does_not_depend_on_the_batch(dtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    packed = layers.prepack_weight(weight)
    x = torch.randn(64, k, generator=g).to(dtype)
    batched = layers.linear(x, weight, bias, packed)
    for rows in (1, 2, 3, 4, 5, 7, 16, 33):
        out = layers.linear(x[:rows], weight, bias, packed)
        assert out.shape == (rows, n) and out.is_contiguous()
        assert torch.equal(out, batched[:rows]), f"{rows} rows"
    # Within what reassociation allows of the plain product (the padding adds nothing).
    plain = torch.nn.functional.linear(x[:1].float(), weight.float(), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(layers.linear(x[:1], weight, bias, packed).float(), plain,
                               rtol=tol, atol=tol * k ** 0.5)


def test_few_rows_run_padded(monkeypatch):
    """The padded rows are what the GEMM sees; a wider batch passes through untouched."""
    seen = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, x, *args):
            seen.append(tuple(x.shape))
            return real(x, *args)

    weight = torch.randn(256, 1408)
    packed = layers.prepack_weight(weight)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Spy(), raising=False)
    for rows in (1, 3, 4, 9, 33, 100):
        layers.linear(torch.randn(rows, 1408), weight, None, packed)
    assert seen == [(layers.MIN_PACKED_ROWS, 1408)] * 2 + [(4, 1408), (9, 1408), (36, 1408), (104, 1408)]


def test_row_counts_run_as_a_bounded_set_of_shapes():
    """oneDNN keeps a primitive per GEMM shape: every row count a prefill tile can have maps to
    one of few shapes (the context worker's RSS grew with each new one), each at least the
    rows it carries and under 1 / PACKED_ROW_STEPS more above EXACT_PACKED_ROWS."""
    shapes = set()
    for rows in range(1, 8193):
        run = layers.packed_rows(rows)
        assert run >= max(rows, layers.MIN_PACKED_ROWS)
        if rows <= layers.EXACT_PACKED_ROWS:
            assert run == max(rows, layers.MIN_PACKED_ROWS)
        else:
            assert run - rows < rows / layers.PACKED_ROW_STEPS
        assert layers.packed_rows(run) == run  # a bucket runs as itself
        shapes.add(run)
    # Exact sizes up to 32, then 8 per doubling: 64 .. 8192 is 8 doublings.
    assert len(shapes) == (layers.EXACT_PACKED_ROWS - layers.MIN_PACKED_ROWS + 1) + 8 * layers.PACKED_ROW_STEPS


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_to_a_bucket_changes_no_row(dtype):
    """Prefill tiles run padded to their bucket: each row equals the same row in a wider GEMM."""
    g = torch.Generator().manual_seed(7)
    n, k = 512, 1408
    weight = torch.randn(n, k, generator=g).to(dtype)
    packed = layers.prepack_weight(weight)
    x = torch.randn(600, k, generator=g).to(dtype)
    wide = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    for rows in (33, 65, 100, 257, 511, 600):
        out = layers.linear(x[:rows], weight, None, packed)
        assert out.shape == (rows, n) and out.is_contiguous()
        assert torch.equal(out, wide[:rows]), f"{rows} rows"
