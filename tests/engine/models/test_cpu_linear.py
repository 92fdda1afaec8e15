"""cpu_linear.linear: F.linear's product, taken as (W x^T)^T for a few rows of a large float32
weight on the CPU (faster there), and F.linear itself everywhere else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.engine.models import cpu_linear


@pytest.mark.parametrize("rows", [1, 2, 5, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(1024, 512, generator=g)  # 2 MiB: above MIN_BYTES
    x = torch.randn(rows, 512, generator=g)
    bias = torch.randn(1024, generator=g) if with_bias else None
    got = cpu_linear.linear(x, weight, bias)
    assert got.shape == (rows, 1024) and got.is_contiguous()
    # the same sums in another order
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=2e-4)


def test_small_weights_and_other_dtypes_are_f_linear_exactly() -> None:
    x = torch.randn(3, 64)
    small = torch.randn(64, 64)
    assert torch.equal(cpu_linear.linear(x, small), F.linear(x, small))
    big = torch.randn(1024, 512).bfloat16()
    xb = torch.randn(3, 512).bfloat16()
    assert torch.equal(cpu_linear.linear(xb, big), F.linear(xb, big))


def test_the_streamed_path_is_taken_for_a_few_rows(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(cpu_linear.torch, "mm", lambda a, b: calls.append(b.shape) or a @ b)
    cpu_linear.linear(torch.randn(1, 512), torch.randn(1024, 512))
    cpu_linear.linear(torch.randn(3, 512), torch.randn(1024, 512))
    cpu_linear.linear(torch.randn(cpu_linear.MAX_ROWS + 1, 512), torch.randn(1024, 512))
    assert calls == [(512, 2), (512, 3)]  # one row is sent twice
