"""benchmarks/comparisons/peers.py on the tiny size: every system runs its cells, a repeated cache decodes every row as
the single row does, matched widths land near the peer's parameter count, and the targets read the right ratios. Skipped
without transformers (the ``bench`` extra); nothing is downloaded."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks.comparisons import peer_systems, peers

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("no_network")


def in_process(case: dict) -> dict:
    with torch.no_grad():
        return {"oom": False, **peers.measure(case)}


def test_quick_run_fills_every_cell_of_the_table_and_the_targets() -> None:
    plan = replace(peers.QUICK, systems=(*peer_systems.OURS, *peer_systems.PEERS, "lrnn=gpt2", "lrnn=mamba"))
    torch.manual_seed(0)
    text = peers.report(plan, peers.run(plan, in_process, log=lambda line: None))
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| system")]
    assert len(rows) == len(plan.systems)
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert "-" not in cells and "failed" not in cells and "OOM" not in cells, row
    targets = [line for line in text.splitlines() if line.startswith("- ")]
    assert len(targets) == 6
    assert all(line.startswith(("- met:", "- missed:")) for line in targets), targets


@pytest.mark.parametrize("system", ["lrnn", "regulargpt", "transformer", "gpt2", "mamba"])
def test_a_repeated_cache_decodes_every_row_as_the_single_row(system: str) -> None:
    torch.manual_seed(0)
    runner, _ = peer_systems.build_system(system, "tiny", positions=64, device=torch.device("cpu"))
    tokens = torch.randint(0, 256, (1, 37))
    token = torch.tensor([5])
    with torch.no_grad():
        single, _ = runner.step(token, runner.prefill(tokens))  # (1, V)
        cache = runner.repeat(runner.prefill(tokens), 3)
        repeated, _ = runner.step(token.expand(3), cache)  # (3, V)
        assert runner.cache_bytes(cache) > 0
    torch.testing.assert_close(repeated, single.expand(3, -1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size", ["s", "L"])
@pytest.mark.parametrize("system", ["lrnn=gpt2", "lrnn=mamba", "regulargpt=mamba", "transformer=mamba"])
def test_matched_systems_have_the_peers_parameter_count_within_ten_percent(system: str, size: str) -> None:
    family, config = peer_systems.system_config(system, size)
    peer, peer_config = peer_systems.system_config(system.split("=")[1], size)
    ours, theirs = peer_systems.count_parameters(family, config), peer_systems.count_parameters(peer, peer_config)
    assert abs(ours - theirs) <= 0.1 * theirs


def synthetic_results(plan: peers.Plan) -> dict:
    """Decode and prefill cells of every system in ``plan`` at the tiny size, one repeat."""
    cell = {"oom": False, "parameters": 1000}
    step = {"lrnn": 1e-3, "regulargpt": 1.5e-3, "gpt2": 4e-3}  # RegularGPT within 2x of the LRNN
    prefill = {"lrnn": 1.0, "regulargpt": 3.0, "gpt2": 1.0}  # RegularGPT's prefill at a third of GPT-2's
    results = {}
    for system in plan.systems:
        for context in (plan.short, plan.long):
            results[(system, "tiny", "decode", context, 1)] = [{**cell, "seconds": step[system]}]
        results[(system, "tiny", "prefill", plan.prefill, 1)] = [{**cell, "seconds": prefill[system]}]
    return results


def test_targets_read_met_and_missed_from_the_ratios() -> None:
    plan = replace(peers.QUICK, systems=("lrnn", "regulargpt", "gpt2"))
    results = synthetic_results(plan)
    lines = [target.line() for target in peers.targets(peers.Figures(plan, results))]
    within_2x = next(line for line in lines if "within 2x" in line)
    half_prefill = next(line for line in lines if "prefill" in line)
    mamba = next(line for line in lines if "Mamba's parameter count" in line)
    assert within_2x.startswith("- met:") and "0.67" in within_2x
    assert half_prefill.startswith("- missed:") and "0.33" in half_prefill
    assert mamba.startswith("- not measured:")


def test_a_saved_run_gives_the_same_report(tmp_path) -> None:
    plan = replace(peers.QUICK, systems=("lrnn", "regulargpt", "gpt2"))
    results = synthetic_results(plan)
    peers.save_results(str(tmp_path / "run.json"), ["a header"], plan, results)
    header, loaded_plan, loaded = peers.load_results(str(tmp_path / "run.json"))
    assert header == ["a header"] and loaded_plan == plan
    assert peers.report(loaded_plan, loaded) == peers.report(plan, results)


@pytest.mark.slow
def test_a_cell_runs_in_its_own_process() -> None:
    case = {
        "device": "cpu",
        "threads": 1,
        "positions": 320,
        "system": "gpt2",
        "size": "tiny",
        "measurement": "decode",
        "length": 64,
        "batch": 2,
    }
    result = peers.isolated(case)
    assert "error" not in result and result["seconds"] > 0 and result["cache_bytes"] > 0
