"""check_paged_inputs: the shape, dtype and device checks both paged attention wrappers share."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.paged_inputs import PagedShapes, check_paged_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(batch: int = 3) -> dict:
    return dict(
        q=torch.zeros(5, 8, 64, device=DEVICE),
        k_cache=torch.zeros(10, 16, 2, 64, device=DEVICE),
        v_cache=torch.zeros(10, 16, 2, 64, device=DEVICE),
        block_tables=torch.zeros(batch, 4, dtype=torch.int32, device=DEVICE),
        num_requests=batch,
        per_request={"seq_lens": (torch.ones(batch, dtype=torch.int32, device=DEVICE), (batch,))},
    )


def test_returns_the_shapes() -> None:
    assert check_paged_inputs("k", **_inputs()) == PagedShapes(
        num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(q=torch.zeros(5, 8 * 64)), r"k: q must be \[tokens, Hq, d\]"),
        (dict(v_cache=torch.zeros(10, 16, 2, 32)), "k_cache and v_cache"),
        (dict(q=torch.zeros(5, 8, 32)), "head dim: q has 32"),
        (dict(q=torch.zeros(5, 7, 64)), "Hq=7 query heads is not a multiple of Hkv=2"),
        (dict(q=torch.zeros(5, 8, 64, dtype=torch.float16)), "dtypes"),
        (dict(block_tables=torch.zeros(2, 4, dtype=torch.int32)), r"block_tables: .*\[B=3"),
        (dict(block_tables=torch.zeros(3, 4, dtype=torch.int64)), "block_tables: expected int32"),
        (dict(block_tables=torch.zeros(4, 3, dtype=torch.int32).t()), "contiguous rows"),
        (
            dict(per_request={"seq_lens": (torch.ones(2, dtype=torch.int32), (3,))}),
            r"seq_lens: expected int32 \(3,\)",
        ),
    ],
    ids=["q-rank", "cache-shapes", "head-dim", "gqa", "dtype", "rows", "int64", "strided", "lens"],
)
def test_rejects(change: dict, match: str) -> None:
    args = _inputs()
    for key, value in change.items():
        if isinstance(value, torch.Tensor):
            value = value.to(DEVICE)
        elif key == "per_request":
            value = {k: (t.to(DEVICE), shape) for k, (t, shape) in value.items()}
        args[key] = value
    with pytest.raises(ValueError, match=match):
        check_paged_inputs("k", **args)


@pytest.mark.gpu
def test_rejects_a_second_device() -> None:
    args = _inputs()
    args["block_tables"] = args["block_tables"].cpu()
    with pytest.raises(ValueError, match="block_tables is on cpu, q on cuda"):
        check_paged_inputs("k", **args)


def test_cpu_tensors_need_the_interpreter(monkeypatch) -> None:
    args = {**_inputs(), **{k: v.cpu() for k, v in _inputs().items() if k.endswith("cache")}}
    args["q"], args["block_tables"] = args["q"].cpu(), args["block_tables"].cpu()
    args["per_request"] = {"seq_lens": (torch.ones(3, dtype=torch.int32), (3,))}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        check_paged_inputs("k", **args)
