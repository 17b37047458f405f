"""``fleet supervise``'s decision and its flags (its loopback run, a SuperLink killed mid-run, is in
tests/test_deploy_loopback.py)."""

from __future__ import annotations

import pytest

from fleet.cli import main
from fleet.commands.supervise import next_step


def test_a_failed_or_stopped_run_is_resumed_until_the_limit_and_a_completed_one_ends_it():
    assert next_step("finished:completed", 0, 3) == "done"
    assert next_step("finished:failed", 0, 3) == "resume" and next_step("finished:stopped", 2, 3) == "resume"
    assert next_step("finished:failed", 3, 3) == "give-up"
    for waiting in ("pending", "starting", "running", None):  # None: the SuperLink did not answer
        assert next_step(waiting, 0, 3) == "wait"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "nope.yaml"], "--config: nope.yaml is not a file"),
        (["--config", "simulations/fleet-tiny.yaml", "--poll-s", "0"], "--poll-s: a number of seconds > 0"),
        (["--config", "simulations/fleet-tiny.yaml", "--app", "/"], "--app: / holds no pyproject.toml"),
    ],
)
def test_bad_flags_are_one_line(capsys, argv, message):
    assert main(["supervise", "pis", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
