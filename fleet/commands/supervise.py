"""``fleet supervise CONNECTION --config simulations/pi.yaml``: submit the run and keep it going.

A SuperLink that restarts (a crash, a reboot, an upgrade) takes the ServerApp with it. With
``--database`` the SuperNodes come back under their node ids by themselves, but the run stays
``finished:failed``. The supervisor submits the run with ``flwr run``, watches it with ``flwr ls``
every ``--poll-s`` seconds, and when the run failed or stopped it submits it again with
``resume=true``: the ServerApp continues from the last finished round's checkpoint, so no finished
round is lost. While the SuperLink is down it keeps asking. It ends when the run completes (exit 0),
or once it has resubmitted ``--max-restarts`` times (exit 1, with the last status). Run it as a
systemd service beside the SuperLink's (scripts/fleet-supervise.service), one line per change.

Design notes:

* **Flower's own CLI.** It drives ``flwr run`` and ``flwr ls --format json`` as a person would, so it
  needs nothing of Flower's internals and works wherever ``flwr`` does.
* **A pure decision.** :func:`next_step` maps the last status seen to what to do; the loop around it
  only runs commands and sleeps, and the decision is tested without a SuperLink.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: flwr's own TOML reader, which flwr installs
    import tomli as tomllib

from fleet.base.errors import ConfigError

COMPLETED, FAILED, STOPPED = "finished:completed", "finished:failed", "finished:stopped"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("supervise", help="submit a deployed run and resubmit it (resume=true) whenever it fails")
    p.add_argument("connection", help="the flwr connection of the SuperLink (flwr's config.toml)")
    p.add_argument("--config", required=True, help="the fleet YAML of the run, as `flwr run` ships it")
    p.add_argument("--app", default=".", help="the app folder `flwr run` packs (default: the current folder)")
    p.add_argument("--run-config", default="", help="more run config, e.g. \"output_dir='/srv/fleet-runs'\"")
    p.add_argument("--poll-s", type=float, default=5.0, help="seconds between status checks (default 5)")
    p.add_argument("--max-restarts", type=int, default=20, help="resubmissions before giving up (default 20)")
    p.set_defaults(func=run)


def next_step(status: str | None, restarts: int, max_restarts: int) -> str:
    """``wait`` (running, or the SuperLink unreachable: ``status`` None), ``done`` (completed), ``resume``
    (it failed or was stopped: submit again with resume=true) or ``give-up`` (too many resumes)."""
    if status == COMPLETED:
        return "done"
    if status in (FAILED, STOPPED) or (status or "").startswith("finished:"):
        return "resume" if restarts < max_restarts else "give-up"
    return "wait"


# What flwr says when retrying cannot help, and the flag to mend: the rest (the SuperLink down, a timeout) is
# waited out. Read from flwr 1.42's messages (tests/test_supervise.py runs them).
FATAL = {
    "not found in the Flower configuration": "connection",
    "Cannot migrate configuration": "connection",
    "is in an invalid format": "--run-config",
}


def refusal(out: dict | None) -> str | None:
    """The one-line error for a flwr reply that no retry will change (an unknown connection, a malformed
    run config), naming the flag and quoting flwr's last line; None for any other reply."""
    message = str((out or {}).get("error-message") or "") if not (out or {}).get("success", True) else ""
    field = next((f for phrase, f in FATAL.items() if phrase in message), None)
    if field is None:
        return None
    last = [line.strip() for line in message.splitlines() if line.strip()][-1]
    return f"{field}: flwr refused it: {last}"


def flwr(args: list[str], app: Path, timeout_s: float = 120) -> dict | None:
    """A ``flwr ... --format json`` command's JSON, or None when it failed (the SuperLink down); a one-line
    ConfigError when flwr refuses what it was given (:func:`refusal`)."""
    exe = shutil.which("flwr") or str(Path(sys.executable).parent / "flwr")
    try:
        done = subprocess.run(
            [exe, *args, "--format", "json"], cwd=app, capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    start = done.stdout.find("{")
    try:
        out = json.loads(done.stdout[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        return None
    refused = refusal(out if isinstance(out, dict) else None)
    if refused is not None:
        raise ConfigError(refused)
    return out


def submit(args: argparse.Namespace, resume: bool) -> int | None:
    """``flwr run`` the app; its run id, or None when the SuperLink did not take it."""
    config = f"config='{Path(args.config).resolve()}' {args.run_config} resume={'true' if resume else 'false'}"
    out = flwr(["run", str(Path(args.app).resolve()), args.connection, "--run-config", config.strip()], Path(args.app))
    if not out or not out.get("success") or out.get("run-id") in (None, ""):
        return None
    return int(out["run-id"])


def status_of(args: argparse.Namespace, run_id: int) -> str | None:
    out = flwr(["ls", args.connection, "--run-id", str(run_id)], Path(args.app))
    runs = (out or {}).get("runs") or []
    return str(runs[0].get("status")) if runs else None


# flwr's own reading of --run-config (flwr.common.config.parse_config_args): each KEY=VALUE, VALUE quoted or
# unspaced, then read as TOML. Text between matches is dropped by flwr without a word.
RUN_CONFIG_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")
SET_HERE = ("config", "resume")  # the keys the supervisor writes itself


def run_config_problem(text: str) -> str | None:
    """Why ``--run-config`` cannot work, or None. flwr drops a word that is no KEY=VALUE silently and refuses
    a list only once it has reached the SuperLink, so a supervisor of an unreachable one retried them forever."""
    pairs, end = [], 0
    for match in RUN_CONFIG_PAIR.finditer(text):
        if text[end : match.start()].strip():
            break
        pairs.append(match.groups())
        end = match.end()
    if text[end:].strip():
        word = (text[end:].split() or [""])[0]
        return f"{word!r} is no KEY=VALUE pair (quote a value with spaces: key='a b')"
    ours = next((k for k, _ in pairs if k in SET_HERE), None)
    if ours is not None:
        return f"{ours} is set by the supervisor (--config; resume on a restart); drop it here"
    try:
        values = tomllib.loads("\n".join(f"{k} = {v}" for k, v in pairs))
    except tomllib.TOMLDecodeError as exc:
        return f"not TOML values ({exc}); write e.g. rounds=20 output_dir='/srv/fleet-runs'"
    bad = next((k for k, v in _flat(values) if not isinstance(v, (bool, int, float, str))), None)
    if bad is not None:
        return f"{bad}: a value must be a number, true/false or a quoted string, not a list or date"
    return None


def _flat(values: dict, prefix: str = "") -> list[tuple[str, object]]:
    """``values`` as (dotted key, value) pairs, as flwr flattens a run config."""
    out: list[tuple[str, object]] = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        out += _flat(value, f"{name}.") if isinstance(value, dict) else [(name, value)]
    return out


def check_args(args: argparse.Namespace) -> None:
    if not args.connection or any(c in args.connection for c in "/\\") or args.connection.endswith(".toml"):
        raise ConfigError(
            f"connection: {args.connection!r} is a path; give the name of a SuperLink connection in flwr's "
            "config.toml (e.g. pis), not the file"
        )
    if not Path(args.config).is_file():
        raise ConfigError(f"--config: {args.config} is not a file; give the run's fleet YAML")
    if not args.poll_s > 0 or args.max_restarts < 0:
        raise ConfigError("--poll-s: a number of seconds > 0, and --max-restarts an integer >= 0")
    problem = run_config_problem(args.run_config)
    if problem is not None:
        raise ConfigError(f"--run-config: {problem}")
    if not (Path(args.app) / "pyproject.toml").is_file():
        raise ConfigError(f"--app: {args.app} holds no pyproject.toml; give the fleet repo, the app `flwr run` packs")


def shown(args: argparse.Namespace, run_id: int | None, status: str | None) -> str:
    """The status line: the run's status, or that the SuperLink did not answer and is asked again (a silent
    wait read as a hang, and the first try's failure used to go unprinted)."""
    if status is not None:
        return f"run {run_id}: {status}"
    what = "no run submitted yet" if run_id is None else f"run {run_id}"
    return f"{what}: SuperLink {args.connection} unreachable; asking again every {args.poll_s:g} s"


def run(args: argparse.Namespace) -> int:
    check_args(args)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    run_id, restarts, last = None, 0, ""  # "": nothing printed yet, so the first try's outcome is shown too
    while True:
        if run_id is None:
            run_id = submit(args, resume=restarts > 0)
            if run_id is not None:
                print(f"supervise: submitted run {run_id}" + (" (resume=true)" if restarts else ""), flush=True)
        status = None if run_id is None else status_of(args, run_id)
        if status != last:
            print(f"supervise: {shown(args, run_id, status)}", flush=True)
            last = status
        step = next_step(status, restarts, args.max_restarts)
        if step == "done":
            return 0
        if step == "give-up":
            print(f"supervise: run {run_id} ended {status} after {restarts} resumes (--max-restarts); see flwr log")
            return 1
        if step == "resume":
            run_id, restarts = None, restarts + 1
            continue
        time.sleep(args.poll_s)
