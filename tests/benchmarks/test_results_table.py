"""benchmarks/accuracy/results_table.py: rows, grids and P(1) columns from eval --json reports."""

from __future__ import annotations

import json

from benchmarks.accuracy.results_table import main


def report(checkpoint: str, task: str, protocol: str, bands: list[tuple[int, int, float | None, float]]) -> dict:
    return {
        "checkpoint": checkpoint,
        "task": task,
        "architecture": "lrnn",
        "protocol": protocol,
        "seed": 1,
        "bands": [{"lengths": [lo, hi], "p_one": p, "samples": 100, "accuracy": a} for lo, hi, p, a in bands],
        "overall": sum(band[3] for band in bands) / len(bands),
    }


def write(tmp_path, reports: list[dict]) -> list[str]:
    paths = []
    for index, value in enumerate(reports):
        path = tmp_path / f"{index}.json"
        path.write_text(json.dumps(value))
        paths.append(str(path))
    return paths


def test_rows_pool_bands_and_name_the_worst(tmp_path, capsys) -> None:
    papers = report(
        "runs/t1-parity_check-lrnn", "parity_check", "papers", [(41, 270, None, 1.0), (271, 500, None, 0.9)]
    )
    hard = report(
        "runs/t1-parity_check-lrnn",
        "parity_check",
        "hard",
        [(501, 2000, None, 1.0), (501, 1000, 0.1, 0.5), (1001, 2000, 0.1, 1.0), (501, 2000, 0.9, 0.99)],
    )
    (tmp_path / "empty.json").write_text("")
    paths = write(tmp_path, [papers, hard]) + [str(tmp_path / "empty.json")]
    assert main(paths) == 0
    out, err = capsys.readouterr()
    row = out.splitlines()[-1]
    assert row.startswith(
        "| parity_check | lrnn | `t1-parity_check-lrnn` | 95.0 (90.0) | 100.0 (100.0) | 75.0 (50.0) | 99.0 (99.0) |"
    )
    assert "skipping" in err and "empty.json" in err
    assert main(["--pivot", *paths]) == 0
    grid = capsys.readouterr().out.splitlines()
    assert grid[0] == "| task | lrnn |" and grid[-1] == "| parity_check | 95.0 |"
    assert main(["--by-p-one", paths[1]]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "| lrnn | `t1-parity_check-lrnn` | 501-2000 | 75.0 | 99.0 |"


def test_pivot_pools_the_seeds_of_a_model(tmp_path, capsys) -> None:
    reports = [
        report(f"runs/t1-even_pairs-lstm{suffix}", "even_pairs", "papers", [(41, 500, None, accuracy)])
        for suffix, accuracy in (("", 0.5), ("-s1", 1.0), ("-s2", 0.9))
    ]
    reports.append(report("runs/t1-even_pairs-rg3", "even_pairs", "papers", [(41, 500, None, 0.635)]))
    assert main(["--pivot", *write(tmp_path, reports)]) == 0
    grid = capsys.readouterr().out.splitlines()
    assert grid[0] == "| task | lstm | rg3 |" and grid[-1] == "| even_pairs | 100.0 / 80.0 (3) | 63.5 |"
