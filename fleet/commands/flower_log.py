"""Flower's and Ray's log during a simulation: to the run's flower.log, off the terminal.

fleet prints one progress line per round; Flower's coloured INFO lines ("configure_train:
Sampled 8 nodes") and Ray's start-up lines would interleave with it. While a simulation
runs, their records go to ``<run>/flower.log``, and the terminal keeps their warnings and
errors (everything with ``verbose``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

FLOWER_LOG = "flower.log"  # Flower's and Ray's log of a simulated run, next to its metrics
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _LogFile(logging.FileHandler):
    """flower.log: timestamped lines without the terminal colours Flower and Ray put into
    messages. Keeps its format when ``ray.init`` re-formats every handler of Ray's logger."""

    def __init__(self, path: Path, level: int) -> None:
        super().__init__(path, mode="a", encoding="utf-8")
        self.setLevel(level)
        self.formatter = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def setFormatter(self, fmt: logging.Formatter | None) -> None:  # noqa: N802 (logging's name)
        pass

    def format(self, record: logging.LogRecord) -> str:
        return _ANSI.sub("", super().format(record))


class _ClientAppErrorsToFile(logging.Filter):
    """Keeps Flower's per-message ClientApp tracebacks off the terminal.

    When a ClientApp raises, Flower logs the exception and its traceback in the
    driver and hands the ServerApp an error reply, which fleet reports as one
    "rejected reply"/"evaluation failed" line per device; the tracebacks stay in
    flower.log, and the terminal is told once where to find them.
    """

    def __init__(self, log_path: Path) -> None:
        super().__init__()
        self.log_path = log_path
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        path = record.pathname.replace(os.sep, "/")
        per_message = (path.endswith("/vce/backend/raybackend.py") and record.funcName == "process_message") or (
            path.endswith("/vce/vce_api.py") and record.funcName == "worker"
        )
        if record.levelno < logging.ERROR or not per_message:
            return True
        if not self.dropped:
            print(f"a ClientApp raised; Flower's tracebacks go to {self.log_path}", file=sys.stderr, flush=True)
        self.dropped += 1
        return False


@contextlib.contextmanager
def flower_output(log_path: Path, *, verbose: bool) -> Iterator[None]:
    """While running: Flower's and Ray's log records in this process (INFO and up; DEBUG with
    ``verbose``) go to ``log_path``; on the terminal only their warnings and errors (Flower's in the
    Ray actors: errors), or everything with ``verbose``. Python warnings raised inside Ray (its
    start-up tips) go to the file only."""
    from flwr.common.logger import FLOWER_LOGGER, ConsoleHandler

    log_path.parent.mkdir(parents=True, exist_ok=True)
    to_file = _LogFile(log_path, logging.DEBUG if verbose else logging.INFO)
    with contextlib.suppress(ImportError):
        import ray  # noqa: F401  (Ray sets up its logger on import: a stderr handler, no propagation)
    ray_logger = logging.getLogger("ray")
    flower_consoles = [h for h in FLOWER_LOGGER.handlers if isinstance(h, ConsoleHandler)]
    consoles = flower_consoles + list(ray_logger.handlers)
    levels = [h.level for h in consoles]
    ray_level = ray_logger.level
    errors_to_file = _ClientAppErrorsToFile(log_path)
    show_warning = warnings.showwarning

    def ray_warnings_to_file(message, category, filename, lineno, file=None, line=None):
        if f"{os.sep}ray{os.sep}" not in filename:
            return show_warning(message, category, filename, lineno, file, line)
        text = warnings.formatwarning(message, category, filename, lineno, "").rstrip()
        to_file.handle(
            logging.makeLogRecord(
                {"name": "py.warnings", "levelno": logging.WARNING, "levelname": "WARNING", "msg": text}
            )
        )

    # Flower in each Ray actor (another process) reads FLWR_LOG_LEVEL on import; its records reach
    # the terminal through Ray's log_to_driver. Keep its errors, not its shutdown warnings
    # ("Manually terminating ClientAppActor"). The actors inherit this environment at ray.init.
    actor_level = not verbose and "FLWR_LOG_LEVEL" not in os.environ
    if actor_level:
        os.environ["FLWR_LOG_LEVEL"] = "ERROR"
    if not verbose:
        for handler in consoles:
            handler.setLevel(max(handler.level, logging.WARNING))
        for handler in flower_consoles:
            handler.addFilter(errors_to_file)
        warnings.showwarning = ray_warnings_to_file
    FLOWER_LOGGER.addHandler(to_file)
    ray_logger.addHandler(to_file)
    try:
        yield
    finally:
        FLOWER_LOGGER.removeHandler(to_file)
        ray_logger.removeHandler(to_file)
        ray_logger.setLevel(ray_level)
        for handler, level in zip(consoles, levels):
            handler.setLevel(level)
            handler.removeFilter(errors_to_file)
        if actor_level:
            os.environ.pop("FLWR_LOG_LEVEL", None)
        if warnings.showwarning is ray_warnings_to_file:
            warnings.showwarning = show_warning
        to_file.close()
