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


@pytest.fixture
def flwr_home(tmp_path, monkeypatch):
    """flwr's config with one connection, ``dead``: a loopback port nothing listens on."""
    (tmp_path / "config.toml").write_text(
        '[superlink]\ndefault = "dead"\n\n[superlink.dead]\naddress = "127.0.0.1:1"\ninsecure = true\n'
    )
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    "connection, extra, message",
    [
        ("nosuch", [], "connection: flwr refused it: An unexpected error occurred"),
        ("/etc/flwr/config.toml", [], "connection: '/etc/flwr/config.toml' is a path"),
        ("dead", ["--run-config", "x='unterminated"], "--run-config: not TOML values (Expected"),
        ("dead", ["--run-config", "rounds=3 oops"], "--run-config: 'oops' is no KEY=VALUE pair"),
        ("dead", ["--run-config", "x=[1,2]"], "--run-config: x: a value must be a number"),
        ("dead", ["--run-config", "resume=true"], "--run-config: resume is set by the supervisor"),
    ],
    ids=["unknown-connection", "a-path", "malformed-run-config", "a-bare-word", "a-list", "resume"],
)
def test_what_no_retry_can_mend_is_one_line_at_once(flwr_home, capsys, connection, extra, message):
    """These were taken for an unreachable SuperLink and retried forever: flwr's own replies (1.42), and the run
    configs flwr drops a word of silently or refuses only once it reaches the SuperLink (checked before any try)."""
    argv = ["supervise", connection, "--config", "simulations/fleet-tiny.yaml", "--poll-s", "0.1", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_an_unreachable_superlink_is_waited_out_not_refused():
    from fleet.commands.supervise import refusal

    down = "Using SuperLink: dead (127.0.0.1:1)\n\nConnection to the SuperLink is unavailable. Please check"
    assert refusal({"success": False, "error-message": down}) is None
    assert refusal({"success": True, "run-id": 3}) is None and refusal(None) is None


def test_an_unreachable_superlink_is_said_from_the_first_try(monkeypatch, capsys):
    """The first try's "unreachable" was never printed (its status equalled the initial one), so a supervisor
    whose SuperLink was down said nothing at all while it retried."""
    from fleet.commands import supervise

    calls = []
    monkeypatch.setattr(supervise, "flwr", lambda args, app, timeout_s=120: calls.append(args[0]))  # None: down

    def stop(seconds: float) -> None:
        if len(calls) >= 4:  # two rounds of tries: printed once, not once per try
            raise KeyboardInterrupt

    monkeypatch.setattr(supervise.time, "sleep", stop)
    assert main(["supervise", "pis", "--config", "simulations/fleet-tiny.yaml", "--poll-s", "7"]) == 130
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["supervise: no run submitted yet: SuperLink pis unreachable; asking again every 7 s"]
    assert calls == ["run"] * 4  # `flwr run` retried each poll, never taken for a refusal
