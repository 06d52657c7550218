"""An overlapped save's serial CPU copy (`StatePlan.copy_cpu_serially`) writes the very bytes
torch's copy does, for every kind of tensor a state holds."""

from __future__ import annotations

import torch

from tierpipe.state import plan_state


def test_the_serial_copy_writes_the_same_image_as_torchs_copy() -> None:
    base = torch.randn(64, 32)
    state = {
        "contiguous": torch.randn(1000),
        "bf16": torch.randn(7, 3, dtype=torch.bfloat16),
        "transposed": base.t(),  # (not contiguous: copied by torch)
        "tied_a": base, "tied_b": base[4:8],  # (one storage: a raw byte span)
        "conj": torch.randn(5, dtype=torch.complex64).conj(),
        "empty": torch.empty(0, 3),
        "flags": torch.tensor([True, False, True]),
        "step": 3,
    }  # fmt: skip
    plan = plan_state(state, job="j", step=1, rank=0, world_size=1, node="n")
    images = [torch.zeros(plan.nbytes, dtype=torch.uint8) for _ in range(2)]
    plan.copy_into(plan.destinations(images[0]))
    plan.copy_cpu_serially(plan.destinations(images[1]))
    assert torch.equal(images[0], images[1])
    assert images[0].count_nonzero() > 0
