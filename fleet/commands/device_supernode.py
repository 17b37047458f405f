"""``fleet device supernode``: Flower's ``flower-supernode``, without its idle sleeps between messages.

Flower's SuperNode serves one message at a time in a loop (``start_client_internal``): pull a message from the
SuperLink, wait for the ClientApp's reply, push it. Two waits in that loop are fixed sleeps:

* when a pull finds no message (the server is still aggregating the last round), it sleeps 3 s before it asks
  again, so every message a device is sent waits 1.5 s on average before the device sees it;
* it looks for the ClientApp's reply every 0.5 s, and then for each of the reply's objects every 0.5 s;
* a message whose objects the ServerApp is still pushing is looked for again after 1 s, then 2 s, and so on
  (:mod:`server.pulls`).

A round of a warm device is a few seconds of work, so these add up to a large share of it. This command runs
Flower's own SuperNode (same flags, same process, same TLS, authentication and isolation) with those two
steps of its loop wrapped: an empty pull asks again after ``--pull-s``, and the reply and its objects are
looked for every ``--reply-poll-s``. Nothing else of the loop changes.

Design notes:

* **Only the empty pull is fast.** The wrap polls ``receive`` itself, so a pull that failed (a FAB that does
  not verify, a run that is gone) still returns and gets Flower's 3 s pause; only "no message yet" is retried
  sooner. Each retry is one small request to the SuperLink: ``--pull-s`` trades a device's idle requests for
  how soon it sees a message.
* **The reply wait ends where Flower's would.** The wrap waits for the reply and its objects, then calls
  Flower's ``_push_messages`` with the replies it took (Flower's look marks a reply retrieved: looked for
  twice, it is found only once). A reply's object that never arrives is left to Flower's own wait after
  ``OBJECT_WAIT_S``.
* **Flower internals.** It wraps ``flwr.supernode.start_client_internal``'s ``_pull_and_store_message`` and
  ``_push_messages`` (flwr pinned: pyproject.toml); ``tests/test_device_supernode.py`` names the missing one
  if they change.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from fleet.commands.device_runtime import poll_seconds
from server.pulls import quick_pulls

OBJECT_WAIT_S = 30.0  # past this, a reply's missing object is Flower's to wait for (its own loop, 0.5 s polls)


def fast_pull(pull: Callable[..., Any], pull_s: float) -> Callable[..., Any]:
    """Flower's pull, with "no message yet" asked again every ``pull_s`` instead of after a 3 s sleep."""

    def pull_soon(*, receive: Callable[[], Any], **kwargs: Any) -> Any:
        def receive_soon() -> Any:
            while (got := receive()) is None:
                time.sleep(pull_s)
            return got

        return pull(receive=receive_soon, **kwargs)

    return pull_soon


class _Taken:
    """The SuperNode's state with its replies already taken: Flower's look for them (which marks what it
    returns as retrieved, so a second look finds nothing) gets these, at once, and all else is the state's."""

    def __init__(self, state: Any, replies: list[Any]) -> None:
        self._state, self._replies = state, replies

    def get_messages_legacy(self, **_: Any) -> list[Any]:
        replies, self._replies = self._replies, []
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


def fast_push(push: Callable[..., Any], poll_s: float) -> Callable[..., Any]:
    """Flower's push, called once the reply and its objects are in (looked for every ``poll_s``, not 0.5 s)."""
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree

    def push_soon(*, state: Any, object_store: Any, **kwargs: Any) -> Any:
        while not (replies := list(state.get_messages_legacy(is_reply=True))):
            time.sleep(poll_s)
        give_up = time.monotonic() + OBJECT_WAIT_S
        for reply in replies:
            for tree in iterate_object_tree(object_store.get_object_tree(reply.metadata.message_id)):
                while object_store.get(tree.object_id) == b"" and time.monotonic() < give_up:
                    time.sleep(poll_s)  # preregistered, its content still on its way from the ClientApp
        return push(state=_Taken(state, replies), object_store=object_store, **kwargs)

    return push_soon


def run(args: argparse.Namespace) -> int:
    """Wrap the two waits, then hand the process to Flower's ``flower-supernode`` with the remaining flags."""
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.cli import flower_supernode

    loop._pull_and_store_message = fast_pull(loop._pull_and_store_message, args.pull_s)
    loop._push_messages = fast_push(loop._push_messages, args.reply_poll_s)
    quick_pulls(loop)  # a message the ServerApp is still pushing is looked for again soon, not after 1-10 s
    flower_args = args.flower_args[1:] if args.flower_args[:1] == ["--"] else args.flower_args
    sys.argv = ["flower-supernode", *flower_args]  # Flower parses its own flags, and refuses bad ones itself
    flower_supernode()
    return 0


def register(device_sub: argparse._SubParsersAction) -> None:
    p = device_sub.add_parser(
        "supernode",
        help="Flower's flower-supernode without its idle sleeps: fleet device supernode [--pull-s S] -- FLAGS",
        description="Runs flower-supernode with FLAGS (everything after --), polling for messages and replies "
        "sooner than Flower's fixed 3 s and 0.5 s sleeps.",
    )
    p.add_argument(
        "--pull-s",
        type=poll_seconds,
        default=0.25,
        help="seconds between pulls while no message waits (Flower sleeps 3 s; default %(default)s)",
    )
    p.add_argument(
        "--reply-poll-s",
        type=poll_seconds,
        default=0.05,
        help="seconds between looks for the ClientApp's reply, a local check (Flower: 0.5 s; default %(default)s)",
    )
    p.add_argument("flower_args", nargs=argparse.REMAINDER, help="-- then flower-supernode's own flags")
    p.set_defaults(func=run)
