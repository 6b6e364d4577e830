"""Training on CUDA: a tiny run on the GPU writes a checkpoint that loads on the CPU and gives the same logits
there, and torchrun with one process per GPU joins an nccl group. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint
from tests.training.helpers import TINY_LRNN, TINY_RUN, read_log, run_module
from training.cli.main import main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY_REGULARGPT = ["--arch", "regulargpt", "--d-model", "8", "--heads", "2", "--d-ff", "16"]


@pytest.mark.parametrize("arch", [TINY_LRNN, TINY_REGULARGPT], ids=["lrnn", "regulargpt"])
def test_tiny_run_on_cuda_writes_a_checkpoint_that_loads_on_the_cpu(arch: list[str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = [
        "train",
        "--task",
        "parity_check",
        "--steps",
        "5",
        "--out",
        str(out),
        "--eval-every",
        "5",
        "--device",
        "cuda",
        *arch,
        *TINY_RUN,
    ]
    assert main(argv) == 0
    on_cpu, on_cuda = load_checkpoint(out, device="cpu"), load_checkpoint(out, device="cuda")
    tokens = torch.randint(0, 2, (2, 50))
    with torch.no_grad():
        expected = on_cpu.model(tokens)
        actual = on_cuda.model(tokens.cuda())
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-4, atol=1e-4)
    assert read_log(out)[-1]["event"] == "end"


def test_torchrun_one_process_per_gpu_uses_nccl(tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    result = run_module(
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={torch.cuda.device_count()}",
        "-m",
        "training",
        "train",
        "--task",
        "parity_check",
        "--steps",
        "3",
        "--out",
        str(out),
        "--eval-every",
        "3",
        "--device",
        "cuda",
        *TINY_LRNN,
        *TINY_RUN,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert load_checkpoint(out, device="cpu").config.metadata["world_size"] == torch.cuda.device_count()


def test_more_processes_than_gpus_is_a_clear_error(tmp_path: Path) -> None:
    result = run_module(
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={torch.cuda.device_count() + 1}",
        "-m",
        "training",
        "train",
        "--task",
        "parity_check",
        "--steps",
        "3",
        "--out",
        str(tmp_path / "x"),
        "--device",
        "cuda",
        *TINY_LRNN,
        *TINY_RUN,
    )
    assert result.returncode != 0
    assert "CUDA device(s); use --nproc_per_node" in result.stderr
