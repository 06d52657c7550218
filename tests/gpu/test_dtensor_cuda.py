"""DTensor state on CUDA (an NCCL mesh of one rank), on a real GPU: `make test-gpu` (skipped where
CUDA is unavailable).

A CUDA DTensor's local shard is staged by the device-to-host copy like any CUDA tensor, sealed
with its block digests, and restored in place into a CUDA DTensor target of the same layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tierpipe.recovery.load import load_into
from tierpipe.storage.reader import read_head
from tierpipe.storage.shard import block_digests
from tierpipe.storage.shardfile import write_shard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeviceMesh]:
    """A 1-rank NCCL group on GPU 0 (destroyed afterwards) and its 1-D mesh."""
    torch.cuda.set_device(0)
    store = tmp_path_factory.mktemp("nccl") / "store"
    dist.init_process_group("nccl", store=dist.FileStore(str(store), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def test_cuda_dtensor_saves_and_restores_in_place(tmp_path: Path, mesh: DeviceMesh) -> None:
    """A CUDA DTensor's shard is saved with its block digests and comes back bitwise into the
    GPU memory of a CUDA DTensor target of the same layout; a replicated bf16 one too."""
    torch.manual_seed(0)
    w = distribute_tensor(torch.randn(3 << 18, device="cuda"), mesh, [Shard(0)])
    r = distribute_tensor(torch.randn(17, 5, device="cuda").bfloat16(), mesh, [Replicate()])
    path = tmp_path / "s.shard"
    write_shard(path, {"w": w, "r": r}, job="j", step=1)
    header = read_head(path).header
    blob = header.blobs[header.tensors[header.sharded[0].tensor].blob]
    local = w.to_local().cpu().view(torch.uint8).numpy().tobytes()
    assert blob.blocks == block_digests(local)
    tw = distribute_tensor(torch.zeros(3 << 18, device="cuda"), mesh, [Shard(0)])
    tr = distribute_tensor(torch.zeros(17, 5, device="cuda").bfloat16(), mesh, [Replicate()])
    ptrs = (tw.to_local().data_ptr(), tr.to_local().data_ptr())
    loaded = load_into(str(path), {"w": tw, "r": tr})
    torch.cuda.synchronize()
    assert torch.equal(tw.to_local(), w.to_local()) and torch.equal(tr.to_local(), r.to_local())
    assert (tw.to_local().data_ptr(), tr.to_local().data_ptr()) == ptrs
    assert loaded.in_place == 2 and isinstance(loaded.state["w"], DTensor)
