"""Running one training command on one process or K of them (``torchrun --nproc_per_node=K``): with torchrun's
environment, a gloo (CPU) or nccl (CUDA, one device per local rank) process group and DistributedDataParallel;
without it, collectives are no-ops.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group exists: see close()
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from model.device import resolve_device


@dataclass(frozen=True)
class Distributed:
    """This process's place in the job: ``rank`` of ``world_size``, on ``device``."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the checkpoint, the log and the progress bar."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model to train: DistributedDataParallel under torchrun, the model itself otherwise."""
        if not self.enabled:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over every process (the same list on each)."""
        if not self.enabled:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()

    def gather(self, value: str) -> list[str]:
        """Every process's ``value``, in rank order, on every process."""
        if not self.enabled:
            return [value]
        values: list[str] = [""] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def close(self) -> None:
        """Destroy the process group and collect what still holds it (DDP sits in reference cycles), so no gloo
        thread outlives it to abort the process at exit; torch.distributed.nn is imported first for the same reason."""
        if dist.is_initialized():
            dist.destroy_process_group()
            gc.collect()

    @property
    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def setup_distributed(device_name: str) -> Distributed:
    """Join the torchrun job described by the environment, if any, on ``device_name`` (auto, cpu, cuda).

    Raises ValueError for a device that is not there.
    """
    device = resolve_device(device_name)
    if "WORLD_SIZE" not in os.environ:
        return Distributed(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"torchrun started {local_world_size} processes on this node but it has "
                f"{torch.cuda.device_count()} CUDA device(s); use --nproc_per_node {torch.cuda.device_count()} "
                "or --device cpu"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    return Distributed(rank, world_size, local_rank, local_world_size, device)
