"""``fleet plan-memory`` and ``fleet bench memory``.

    fleet plan-memory --model resnet18 --batch-size 32 --input-size 32 --budget-fraction 0.5 --json
    fleet bench memory --model resnet18 --budget-fraction 0.3 --rho 0.5 --json

Budgets are in MB (10**6 bytes) or a fraction of the unconstrained activation
peak. Each handler returns an exit code; user errors raise FleetError, which
the main CLI prints as one ``error:`` line. The planner's budget errors name
quantities; :func:`_budget_flags` re-raises them naming this command's flags.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator

from fleet.base.errors import ConfigError
from fleet.commands.common import model_kwargs, require_counts


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model name, e.g. resnet18, mobilenet_v2")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--input-size", type=int, default=32, help="image height and width")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--in-channels", type=int, default=3)
    p.add_argument("--small-input", action="store_true", help="the model's small-input stem (32x32 images)")
    p.add_argument("--objective", choices=("time", "energy"), default="time", help="what the plan minimizes")
    p.add_argument("--spill-dir", help="directory for paged activations (default: a temporary directory)")
    p.add_argument("--sync", action="store_true", help="fsync spill files and drop them from the page cache")
    p.add_argument("--overlap", action="store_true", help="page in the background and prefetch where memory allows")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def register_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan-memory", help="plan keep/recompute/page per block under a memory budget")
    _model_args(p)
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-mb", type=float, help="activation memory budget in MB (10**6 bytes)")
    budget.add_argument("--budget-fraction", type=float, help="budget as a fraction of the unconstrained peak")
    p.add_argument("--frozen-below", help="input-most trained block (chain index or name); blocks below store nothing")
    p.add_argument("--compute-watts", type=float, help="power while computing, for --objective energy")
    p.add_argument("--storage-watts", type=float, help="power while paging, for --objective energy")
    p.add_argument("--repeats", type=int, default=3, help="timed steps when profiling; medians are kept")
    p.add_argument("--out", help="write the plan (YAML) here")
    p.add_argument("--profile-out", help="write the measured memory profile (YAML) here")
    p.set_defaults(func=run_plan)


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("memory", help="run a memory plan and measure its peak and time overhead")
    _model_args(p)
    p.add_argument("--budget-fraction", type=float, required=True, help="fraction of the unconstrained peak")
    p.add_argument("--repeats", type=int, default=15, help="interleaved planned/unplanned step pairs")
    p.add_argument("--profile-repeats", type=int, default=5, help="timed steps per variant when profiling")
    p.add_argument("--rho", type=float, help="also run with elastic selection at this time fraction")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (a CUDA GPU where there is one), cpu or cuda")
    p.set_defaults(func=run_bench)


def _threads(args) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads: got {args.threads}; use 1 or more")
        import torch

        torch.set_num_threads(args.threads)


def _frozen_below(value: str | None, blocks: list[str]) -> int | None:
    if value is None:
        return None
    if value.lstrip("-").isdigit():
        return int(value)
    if value in blocks:
        return blocks.index(value)
    raise ConfigError(
        f"--frozen-below: {value!r} is not a block of this model; use an index 0..{len(blocks)} or one of "
        f"{', '.join(blocks[:6])}, ..."
    )


def _mb(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


@contextlib.contextmanager
def _budget_flags(mb_flag: str | None, fraction_flag: str) -> Iterator[None]:
    """Re-raise the planner's budget errors naming this command's budget flags."""
    from fleet.memory.planner import BudgetValueError, InfeasibleBudgetError

    flags = {"budget_mb": mb_flag, "budget_fraction": fraction_flag}
    try:
        yield
    except InfeasibleBudgetError as exc:
        raise exc.named(mb_flag, fraction_flag) from None
    except BudgetValueError as exc:
        if flags.get(exc.field) is None:
            raise
        raise exc.named(flags[exc.field]) from None


def run_plan(args: argparse.Namespace) -> int:
    require_counts(args, "repeats", "threads")
    import yaml

    from fleet.bench.memory import bench_model
    from fleet.memory.measure import measure_block_costs
    from fleet.memory.planner import min_feasible_budget, plan_memory, resolve_budget
    from fleet.memory.storage import measure_storage

    _threads(args)
    start = time.perf_counter()
    model = bench_model(args.model, args.num_classes, in_channels=args.in_channels, small_input=args.small_input)
    spill = args.spill_dir or os.path.join(tempfile.gettempdir(), "fleet-spill")
    storage = measure_storage(spill, sync=args.sync, storage_watts=args.storage_watts)
    shape = (args.batch_size, args.in_channels, args.input_size, args.input_size)
    profile = measure_block_costs(
        model, shape, model_name=args.model, repeats=args.repeats, storage=storage, compute_watts=args.compute_watts
    )
    profile_s = time.perf_counter() - start
    blocks = [b.name for b in profile.blocks]
    fb = _frozen_below(args.frozen_below, blocks)
    with _budget_flags("--budget-mb", "--budget-fraction"):
        budget = resolve_budget(profile, budget_mb=args.budget_mb, budget_fraction=args.budget_fraction)
        plan = plan_memory(profile, budget, objective=args.objective, frozen_below=fb, overlap=args.overlap)
    if args.profile_out:
        with open(args.profile_out, "w") as f:
            yaml.safe_dump(profile.to_dict(), f, sort_keys=False)
    if args.out:
        with open(args.out, "w") as f:
            yaml.safe_dump(plan.to_dict(), f, sort_keys=False)
    minimum = min_feasible_budget(profile, frozen_below=fb)
    if args.json:
        out = plan.to_dict()
        out.update(
            min_feasible_bytes=minimum,
            measured_unconstrained_peak_bytes=profile.measured_peak_bytes,
            plan_summary=plan.summary(),
            profile_s=profile_s,
            step_s=profile.step_s,
        )
        print(json.dumps(out))
    else:
        _print_plan(args, plan, budget, minimum, profile.step_s)
    return 0


def _print_plan(args: argparse.Namespace, plan, budget: int, minimum: int, step_s: float) -> None:
    print(
        f"{args.model} at batch {args.batch_size}, {args.input_size}x{args.input_size}: unconstrained peak "
        f"{_mb(plan.unconstrained_peak_bytes)}, budget {_mb(budget)}, planned peak {_mb(plan.predicted_peak_bytes)} "
        f"(smallest feasible {_mb(minimum)}); added {1000 * plan.added_time_s:.1f} ms per step "
        f"(step {1000 * step_s:.0f} ms); solved in {plan.solve_time_s:.2f}s"
    )
    print(f"{'block':<24}{'action':<11}{'peak in its backward':>22}")
    for name, action, overlap, peak in zip(plan.blocks, plan.actions, plan.overlap, plan.block_peaks):
        label = action + ("+" if overlap else "")
        print(f"{name or '(model)':<24}{label:<11}{_mb(peak):>22}")
    print("(page+ : written in the background and prefetched)")


def run_bench(args: argparse.Namespace) -> int:
    require_counts(args, "repeats", "profile_repeats", "threads")
    from fleet.bench.memory import run_memory_bench
    from fleet.engine.accelerator import resolve_device

    device = resolve_device(args.device, "--device")
    _threads(args)
    with _budget_flags(None, "--budget-fraction"):
        out = run_memory_bench(
            args.model,
            args.budget_fraction,
            args.batch_size,
            args.input_size,
            repeats=args.repeats,
            profile_repeats=args.profile_repeats,
            rho=args.rho,
            spill_dir=args.spill_dir,
            objective=args.objective,
            sync=args.sync,
            overlap=args.overlap,
            seed=args.seed,
            device=device,
            **model_kwargs(args),
        )
    if args.json:
        print(json.dumps(out))
        return 0
    rows = [("full training", out)]
    if "elastic" in out:
        rows.append((f"elastic rho={out['elastic']['rho']}", out["elastic"]))
    print(
        f"{args.model} at batch {args.batch_size}, {args.input_size}x{args.input_size}: budget "
        f"{_mb(out['budget_bytes'])} = {args.budget_fraction} x unconstrained {_mb(out['unconstrained_peak_bytes'])}"
    )
    print(f"{'':<18}{'unplanned peak':>16}{'predicted':>12}{'measured':>12}{'in budget':>11}{'overhead':>10}  plan")
    for label, r in rows:
        print(
            f"{label:<18}{_mb(r['unconstrained_peak_bytes']):>16}{_mb(r['predicted_peak_bytes']):>12}"
            f"{_mb(r['measured_peak_bytes']):>12}{str(r['within_budget']):>11}{100 * r['time_overhead']:>9.1f}%  "
            f"{r['plan']}"
        )
    return 0
