"""``fleet device supernode``: Flower's ``flower-supernode``, without its idle waits between messages.

Flower's SuperNode serves one message at a time in a loop (``start_client_internal``): pull a message from the
SuperLink, wait for the ClientApp's reply, push it. Its waits in that loop are fixed sleeps and backoffs:

* when a pull finds no message (the server is still aggregating the last round), it sleeps 3 s before it asks
  again, so every message a device is sent waits 1.5 s on average before the device sees it;
* it looks for the ClientApp's reply every 0.5 s, and then for each of the reply's objects every 0.5 s;
* a message whose objects the ServerApp is still pushing is looked for again after 1 s, then 2 s, and so on;
* the message's objects reach the ClientApp only once all have arrived, and the reply's leave only once the
  ClientApp has stored them all.

A round of a warm device is a few seconds of work, so these add up to a large share of it. This command runs
Flower's own SuperNode (same flags, same process, same TLS, authentication and isolation) with two steps of
its loop wrapped and its object pulls quickened (:mod:`server.pulls`): an empty pull asks again after
``--pull-s``, the reply is looked for every ``--reply-poll-s``, and objects pass through as they land, both
ways. Nothing else of the loop changes.

Design notes:

* **Only the empty pull is fast.** The wrap polls ``receive`` itself, so a pull that failed (a FAB that does
  not verify, a run that is gone) still returns and gets Flower's 3 s pause; only "no message yet" is retried
  sooner. Each retry is one small request to the SuperLink: ``--pull-s`` trades a device's idle requests for
  how soon it sees a message.
* **The reply wait ends where Flower's would.** The wrap waits for the reply, then calls Flower's
  ``_push_messages`` with the replies it took (Flower's look marks a reply retrieved: looked for twice, it is
  found only once). A reply's object that never arrives is left to Flower's own wait after ``OBJECT_WAIT_S``.
* **A reply's objects go up as they land.** Flower's push announces the reply to the SuperLink and then sends
  its objects in the order of its object tree, each once it is in the store. The wrap hands it the store with
  a look that waits for an object still on its way (every ``--reply-poll-s``), so the upload of the first
  chunks overlaps the ClientApp's copy of the last ones into the SuperNode (1.2 s of a pi4's round for 22 MB).
* **A task takes each object as it lands.** Flower's SuperNode pulls a message's objects (its arrays, in 5 MB
  chunks) and stores them all once the last is in; only then could its task pull them, over the SuperNode's
  local API, at the device's own slow core (2.2 s of a pi4's round for 22 MB, after 4 s of download). Here the
  SuperNode pulls them one at a time, in the order of Flower's object tree, and stores each as it lands; the
  task (``fleet device runtime``) pulls them in the same order, one at a time, so it copies and checks each
  chunk while the next one downloads.
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
    """Flower's pull, with "no message yet" asked again every ``pull_s`` instead of after a 3 s sleep, and each
    of the message's objects stored as it lands (design note: a task takes each object as it lands)."""

    def pull_soon(
        *, receive: Callable[[], Any], pull_object: Callable[..., bytes], object_store: Any, **kw: Any
    ) -> Any:
        def receive_soon() -> Any:
            while (got := receive()) is None:
                time.sleep(pull_s)
            return got

        def pull_and_store(run_id: int, object_id: str) -> bytes:
            content = pull_object(run_id, object_id)
            object_store.put(object_id, content)  # checked against its id there, as Flower's own put checks it
            return content

        store = _StoredOnce(object_store)
        return pull(receive=receive_soon, pull_object=pull_and_store, object_store=store, **kw)

    return pull_soon


class _StoredOnce:
    """The SuperNode's object store, where Flower's loop puts the objects it pulled once all are in: each was
    put as it landed, and may be gone already (its task took it and confirmed), so only an object still
    awaited is put (a second put would hash 22 MB again, and one of a deleted object fails the message)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def put(self, object_id: str, content: bytes) -> None:
        if self._store.get(object_id) == b"":  # preregistered, not yet in
            self._store.put(object_id, content)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


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
    """Flower's push, called once the reply is in, each of its objects sent on as soon as it is in (both looked
    for every ``poll_s``, not 0.5 s; design note: a reply's objects go up as they land)."""

    def push_soon(*, state: Any, object_store: Any, **kwargs: Any) -> Any:
        while not (replies := list(state.get_messages_legacy(is_reply=True))):
            time.sleep(poll_s)
        store = _Arriving(object_store, poll_s, time.monotonic() + OBJECT_WAIT_S)
        return push(state=_Taken(state, replies), object_store=store, **kwargs)

    return push_soon


class _Arriving:
    """The SuperNode's object store, where a look for an object still on its way from the ClientApp waits for it,
    looking every ``poll_s``, until ``give_up``; then it is Flower's to wait for (its own loop, 0.5 s sleeps)."""

    def __init__(self, store: Any, poll_s: float, give_up: float) -> None:
        self._store, self._poll_s, self._give_up = store, poll_s, give_up

    def get(self, object_id: str) -> bytes | None:
        while (content := self._store.get(object_id)) == b"" and time.monotonic() < self._give_up:
            time.sleep(self._poll_s)  # preregistered, its content still on its way from the ClientApp
        return content

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def run(args: argparse.Namespace) -> int:
    """Wrap the two waits, then hand the process to Flower's ``flower-supernode`` with the remaining flags."""
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.cli import flower_supernode

    loop._pull_and_store_message = fast_pull(loop._pull_and_store_message, args.pull_s)
    loop._push_messages = fast_push(loop._push_messages, args.reply_poll_s)
    # a message the ServerApp is still pushing is looked for again soon, not after 1-10 s, and its objects come
    # one at a time, in the order its task pulls them (design note: a task takes each object as it lands)
    quick_pulls(loop, max_concurrent_pulls=1)
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
