"""``plan-memory`` and ``bench memory`` through their argparse registration."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import yaml

from fleet.base.errors import BudgetError, ConfigError
from fleet.commands.memory import _budget_flags, register_bench, register_plan
from fleet.memory.planner import BudgetValueError, InfeasibleBudgetError, MemoryPlan


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleet")
    sub = p.add_subparsers(dest="command", required=True)
    register_plan(sub)
    bench = sub.add_parser("bench")
    register_bench(bench.add_subparsers(dest="bench", required=True))
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


def test_plan_memory_json_and_files(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    spill = tmp_path / "spill"
    code = run(
        "plan-memory --model resnet18 --batch-size 2 --input-size 32 --budget-fraction 0.4 "
        f"--spill-dir {spill} --repeats 1 --out {out} --json".split()
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["predicted_peak_bytes"] <= result["budget_bytes"]
    assert result["budget_bytes"] == int(0.4 * result["unconstrained_peak_bytes"])
    assert result["min_feasible_bytes"] <= result["budget_bytes"]
    assert len(result["actions"]) == len(result["blocks"])
    plan = MemoryPlan.from_dict(yaml.safe_load(out.read_text()))
    assert plan.actions == result["actions"]
    assert os.listdir(spill) == []


def test_plan_memory_table_and_frozen_by_name(tmp_path, capsys):
    code = run(
        "plan-memory --model resnet18 --batch-size 2 --budget-mb 1 --frozen-below layer3.0 "
        f"--spill-dir {tmp_path} --repeats 1".split()
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "budget 1.00 MB" in text and "layer2.1" in text and "frozen" in text


def test_plan_memory_errors(tmp_path):
    with pytest.raises(
        BudgetError,
        match=r"^memory budget 0\.01 MB is infeasible for resnet18 at batch 2; the smallest feasible budget is "
        r"([0-9.]+) MB \(--budget-mb \1, or --budget-fraction [0-9.]+ of the unconstrained [0-9.]+ MB\)$",
    ):
        run(f"plan-memory --model resnet18 --batch-size 2 --budget-mb 0.01 --spill-dir {tmp_path} --repeats 1".split())
    with pytest.raises(
        ConfigError, match=r"^budget_mb: got -1\.0; use a positive number of MB, e\.g\. --budget-mb 20$"
    ):
        run(f"plan-memory --model resnet18 --batch-size 2 --budget-mb -1 --spill-dir {tmp_path} --repeats 1".split())
    with pytest.raises(ConfigError, match="--frozen-below: 'layer9' is not a block"):
        run(
            "plan-memory --model resnet18 --batch-size 2 --budget-mb 1 --frozen-below layer9 "
            f"--spill-dir {tmp_path} --repeats 1".split()
        )
    with pytest.raises(SystemExit):  # argparse: exactly one budget flag
        run(["plan-memory", "--model", "resnet18", "--budget-mb", "1", "--budget-fraction", "0.5"])


def test_budget_errors_name_the_commands_flags():
    infeasible = InfeasibleBudgetError(10_000, 2_345_678, 5_000_000, "resnet18 at batch 2")
    with pytest.raises(
        BudgetError, match=r"is 2\.4 MB \(--budget-mb 2\.4, or --budget-fraction 0\.47 of the unconstrained 5\.0 MB\)$"
    ):
        with _budget_flags("--budget-mb", "--budget-fraction"):
            raise infeasible
    with pytest.raises(BudgetError, match=r"is 2\.4 MB \(--budget-fraction 0\.47 of the unconstrained 5\.0 MB\)$"):
        with _budget_flags(None, "--budget-fraction"):  # bench memory has no --budget-mb
            raise infeasible
    with pytest.raises(
        ConfigError, match=r"^budget_fraction: got 0; use a positive fraction, e\.g\. --budget-fraction 0\.5$"
    ):
        with _budget_flags(None, "--budget-fraction"):
            raise BudgetValueError("budget_fraction", 0)


def test_bench_memory_json(tmp_path, capsys):
    code = run(
        "bench memory --model resnet18 --budget-fraction 0.5 --batch-size 2 --repeats 1 "
        f"--profile-repeats 1 --rho 0.5 --spill-dir {tmp_path} --json".split()
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    for key in (
        "unconstrained_peak_bytes",
        "budget_bytes",
        "measured_peak_bytes",
        "time_overhead",
        "process_hwm_bytes",
    ):
        assert key in result
    assert result["measured_peak_bytes"] <= result["budget_bytes"] and result["within_budget"]
    elastic = result["elastic"]
    assert elastic["unconstrained_peak_bytes"] < result["unconstrained_peak_bytes"]
    assert elastic["measured_peak_bytes"] <= result["budget_bytes"]
    assert elastic["predicted_added_s"] <= result["predicted_added_s"]
    assert os.listdir(tmp_path) == []


def test_bench_memory_runs_where_device_says(monkeypatch):
    import torch

    from fleet.bench import memory as bench_memory

    seen = {}
    monkeypatch.setattr(bench_memory, "run_memory_bench", lambda *a, **kw: seen.update(kw) or {"model": "x"})
    assert run("bench memory --model resnet18 --budget-fraction 0.5 --device cpu --json".split()) == 0
    assert seen["device"] == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="^--device: cuda, but torch sees no CUDA GPU"):
            run("bench memory --model resnet18 --budget-fraction 0.5 --device cuda --json".split())
