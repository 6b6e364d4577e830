"""Running one training command on one process or K of them (``torchrun --nproc_per_node=K``).

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK (and the rendezvous address); when they are there the process
group is initialised with gloo on the CPU or nccl on CUDA, each process takes the CUDA device of its local
rank, and the model is wrapped in DistributedDataParallel. Without them everything runs in this process.
Collectives here are no-ops on one process, so the training loop reads the same either way.
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
        """Destroy the process group and collect what still holds it, which stops gloo's threads there and then.

        A gloo thread alive at interpreter exit aborts the process ("terminate called without an active
        exception", about one exit in 25): it frees a finished collective's tensors, which needs the GIL, and a
        thread that asks for the GIL while the interpreter finalizes is ended by pthread_exit inside a C++
        destructor. So nothing may keep the group past here:
        - DistributedDataParallel sits in reference cycles, freed only by a collection: without ``gc.collect()``
          the wrapper of a finished run held the group (and its threads) to the collection at exit;
        - torch.distributed.nn binds ``group.WORLD`` as a default argument of its functions when first imported,
          and DistributedDataParallel imports it; imported after ``init_process_group`` it would keep the group for
          good. This module imports it first, while WORLD is None.
        """
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
