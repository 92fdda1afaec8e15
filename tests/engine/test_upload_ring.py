"""UploadRing: a group of host arrays reaches the device intact, in one copy, and its views
stay valid while later groups are sent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.engine.upload_ring import ALIGN, UploadRing


def _group(rng: np.random.Generator, rows: int) -> list[np.ndarray]:
    """Arrays of the shapes and dtypes a step sends, odd sizes and an empty one included."""
    return [
        rng.integers(0, 1 << 40, rows, dtype=np.int64),
        rng.integers(0, 1 << 20, (rows, 7), dtype=np.int32),
        rng.random((6, rows), dtype=np.float32),
        rng.random(rows) < 0.5,
        np.arange(0, dtype=np.int64),
        np.asfortranarray(rng.integers(0, 9, (3, 5), dtype=np.int32)),  # not C-contiguous
    ]


def test_on_cpu_the_arrays_come_back_as_tensors_sharing_memory() -> None:
    ring = UploadRing(torch.device("cpu"))
    a = np.arange(5, dtype=np.int64)
    (t,) = ring.upload([a])
    t[0] = 9
    assert a[0] == 9 and t.dtype == torch.int64


def test_groups_come_back_group_by_group_in_one_call() -> None:
    ring = UploadRing(torch.device("cpu"))
    rng = np.random.default_rng(1)
    first, second = _group(rng, 5), []
    third = [np.arange(3, dtype=np.int64)]
    views = ring.upload_groups(first, second, third)
    assert ring.calls == 1 and [len(v) for v in views] == [len(first), 0, 1]
    for host, dev in zip(first + third, views[0] + views[2], strict=True):
        assert torch.equal(dev, torch.from_numpy(np.ascontiguousarray(host)))


def test_depth_below_two_is_refused() -> None:
    with pytest.raises(ValueError, match="depth >= 2"):
        UploadRing(torch.device("cpu"), depth=1)


@pytest.mark.gpu
def test_groups_arrive_intact_and_stay_valid_for_depth_minus_one_calls() -> None:
    device = torch.device("cuda")
    ring = UploadRing(device, depth=3, initial_bytes=256)  # small: slots must grow
    rng = np.random.default_rng(0)
    sent: list[tuple[list[np.ndarray], list[torch.Tensor]]] = []
    for call, rows in enumerate([3, 1000, 17, 1, 4096, 0, 33, 2048]):
        arrays = _group(rng, rows)
        views = ring.upload(arrays)
        sent.append((arrays, views))
        for host, dev in zip(arrays, views, strict=True):
            assert dev.device.type == "cuda" and dev.shape == host.shape
            assert dev.data_ptr() % ALIGN == 0 or dev.numel() == 0
        for arrays_k, views_k in sent[max(0, call - 2) :]:  # this call and the two before
            for host, dev in zip(arrays_k, views_k, strict=True):
                assert torch.equal(dev.cpu(), torch.from_numpy(np.ascontiguousarray(host)))


@pytest.mark.gpu
def test_a_slot_is_rewritten_only_after_its_copy_has_run() -> None:
    device = torch.device("cuda")
    ring = UploadRing(device, depth=2)
    torch.cuda._sleep(200_000_000)  # keep the stream busy: the copies below wait behind it
    first = ring.upload([np.full(1000, 1, dtype=np.int64)])[0]
    out = first * 1  # enqueued before the slot's next copy: must read 1s
    ring.upload([np.full(10, 2, dtype=np.int64)])
    ring.upload([np.full(1000, 3, dtype=np.int64)])  # slot 0 again: waits for copy 1
    assert int(out.sum()) == 1000  # the pinned 1s were not overwritten before their copy
