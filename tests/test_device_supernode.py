"""``fleet device supernode``: Flower's SuperNode loop with its idle sleeps cut, and nothing else changed.

The fast tests pin the Flower internals the command wraps (each failure names the missing function in one
line), time the two wraps against Flower's own objects, and check its flags. The real SuperNodes it runs are
in the slow tests: tests/test_device_runtime.py (warm devices) and the secure ones of
tests/test_deploy_loopback.py and tests/test_link_security.py (TLS, SuperNode authentication, the proxy).
"""

from __future__ import annotations

import inspect
import subprocess
import threading
import time

import numpy as np
import pytest

from fleet.commands import device_supernode
from tests.conftest import cli_refusal
from tests.test_deploy_loopback import BIN

# module -> the names the command uses from it, with the parameters it relies on
FLOWER_API = {
    "flwr.supernode.start_client_internal": {
        "_pull_and_store_message": ("receive", "state", "object_store", "pull_object"),
        "_push_messages": ("state", "object_store"),
    },
    "flwr.supernode.cli": {"flower_supernode": ()},
    "flwr.supercore.inflatable.inflatable_object": {"iterate_object_tree": ("tree",), "get_object_tree": ("obj",)},
}


def test_the_flower_internals_the_supernode_wrap_uses_are_there():
    import importlib

    for module_name, names in FLOWER_API.items():
        module = importlib.import_module(module_name)
        for name, params in names.items():
            assert hasattr(module, name), f"flwr changed: {module_name}.{name} is gone (fleet device supernode uses it)"
            missing = set(params) - set(inspect.signature(getattr(module, name)).parameters)
            assert not missing, f"flwr changed: {module_name}.{name} lost its parameters {sorted(missing)}"


def test_flowers_loop_calls_the_wrapped_steps_by_keyword_through_the_module():
    """The wrap replaces module attributes: Flower's loop must look them up there, passing keywords."""
    from flwr.supernode import start_client_internal as loop

    source = inspect.getsource(loop.start_client_internal)
    for call in ("_pull_and_store_message(", "_push_messages("):
        assert call in source, f"flwr changed: start_client_internal no longer calls {call[:-1]}"
    passed = ("receive=receive", "state=state", "object_store=store", "pull_object=pull_object")
    assert all(p in source for p in passed), (
        "flwr changed: start_client_internal no longer passes receive/state/object_store/pull_object by keyword"
    )
    pull_source = inspect.getsource(loop._pull_and_store_message)
    assert "pull_objects(" in pull_source and "object_store.put(" in pull_source, (
        "flwr changed: _pull_and_store_message no longer pulls with pull_objects and puts into the object store"
    )


def test_an_empty_pull_asks_again_soon_and_a_failed_pull_keeps_its_answer():
    answers = [None, None, ("message", "tree")]
    asked: list[float] = []

    def receive():
        asked.append(time.monotonic())
        return answers.pop(0)

    def flower_pull(*, receive, state, pull_object, object_store):
        got = receive()
        return None if got is None else (state, got)

    start = time.monotonic()
    pull = device_supernode.fast_pull(flower_pull, 0.05)
    assert pull(receive=receive, state="s", pull_object=None, object_store=None) == ("s", ("message", "tree"))
    assert len(asked) == 3 and time.monotonic() - start < 1.0  # Flower would have slept 3 s twice
    assert 0.04 <= asked[1] - asked[0] < 0.5, asked
    failed = device_supernode.fast_pull(lambda **_: None, 0.05)(
        receive=lambda: ("message", "tree"), pull_object=None, object_store=None
    )
    assert failed is None  # a pull that failed on a message returns to Flower's loop and its 3 s pause


def flower_node():
    """Flower's own SuperNode state and object store, as ``start_client_internal`` makes them."""
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supernode.nodestate import NodeStateFactory

    stores = ObjectStoreFactory()
    return NodeStateFactory(stores).state(), stores.store()


def reply_preregistered(store):
    """A real reply Message with arrays, its objects preregistered in ``store``, their contents not yet in."""
    from flwr.app import ArrayRecord, Message, Metadata, RecordDict
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

    meta = Metadata(
        run_id=1,
        message_id="",
        src_node_id=7,
        dst_node_id=1,
        reply_to_message_id="to-device",
        group_id="1",
        created_at=time.time(),
        ttl=60.0,
        message_type="train",
    )
    message = Message(RecordDict({"arrays": ArrayRecord([np.ones(1000, np.float32)])}), metadata=meta)
    message.metadata.__dict__["_message_id"] = message.object_id  # as Flower's runtime API stores a reply
    store.preregister(1, get_object_tree(message))
    return message, {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}


def test_each_object_of_a_message_is_stored_as_it_lands_and_flowers_put_after_all_is_harmless():
    """The task can take an object while the next downloads (design note: a task takes each object as it lands):
    each is in the store once pulled, checked against its id. Flower's own put of them all afterwards puts
    nothing again, even where the task already took the message and it was deleted."""
    from flwr.supercore.inflatable.inflatable_object import get_object_tree

    _, store = flower_node()
    message, contents = reply_preregistered(store)
    order = [t.object_id for t in iterate(get_object_tree(message))]
    seen: list[list[bool]] = []

    def flower_pull(*, receive, pull_object, object_store):  # Flower's: every object pulled, then every one put
        receive()
        got = {}
        for oid in order:
            got[oid] = pull_object(1, oid)
            seen.append([store.get(o) not in (None, b"") for o in order])
        store.delete(message.object_id)  # its task took the message and confirmed it before Flower's puts
        for oid, content in got.items():
            object_store.put(oid, content)
        return 1

    pull = device_supernode.fast_pull(flower_pull, 0.05)
    assert (
        pull(receive=lambda: ("message", "tree"), pull_object=lambda run, oid: contents[oid], object_store=store) == 1
    )
    assert seen == [[j <= i for j in range(len(order))] for i in range(len(order))]  # each in as it landed
    _, store = flower_node()
    reply_preregistered(store)  # the same arrays again, in a fresh store
    forged = device_supernode.fast_pull(flower_pull, 0.05)
    with pytest.raises(ValueError, match="does not match"):  # an object that is not what its id says is refused
        forged(receive=lambda: ("message", "tree"), pull_object=lambda run, oid: b"forged", object_store=store)


def push_with_flower(state, store, timeout: float = 10.0) -> list[tuple[float, str, bytes]]:
    """Flower's own ``_push_messages`` behind the wrap, sending to a SuperLink that takes every object;
    each object pushed with when. Fails if the push does not end within ``timeout``."""
    from flwr.supernode import start_client_internal as loop

    sent: list[tuple[float, str, bytes]] = []
    send = lambda message, tree, runtime: ({t.object_id for t in iterate(tree)}, "session")  # noqa: E731
    push_object = lambda run_id, session, oid, content: sent.append((time.monotonic(), oid, content))  # noqa: E731
    push = device_supernode.fast_push(loop._push_messages, 0.02)
    worker = threading.Thread(
        target=push, kwargs=dict(state=state, object_store=store, send=send, push_object=push_object)
    )
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), "the push never ended: the wrap took the reply Flower's push looks for"
    return sent


def iterate(tree):
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree

    return iterate_object_tree(tree)


def test_the_reply_goes_once_it_and_its_objects_are_in_and_no_later():
    state, store = flower_node()
    message, contents = reply_preregistered(store)
    arrived: list[float] = []

    def client_app():  # its reply first, then the reply's objects, as Flower's runtime API stores them
        time.sleep(0.3)
        state.store_message(message)
        time.sleep(0.2)
        for oid, content in contents.items():
            store.put(oid, content)
        arrived.append(time.monotonic())

    threading.Thread(target=client_app).start()
    sent = push_with_flower(state, store)
    assert {oid: content for _, oid, content in sent} == contents  # every object, as the ClientApp made it
    assert 0 <= sent[0][0] - arrived[0] < 0.15, (sent[0][0], arrived)  # Flower's own waits: up to 0.5 s each
    assert not state.get_messages_legacy(is_reply=True)  # sent once, and gone from the state as Flower does


def test_each_object_of_a_reply_goes_up_as_it_lands_not_once_all_are_in():
    """Design note: a reply's objects go up as they land. The ClientApp stores them one by one, 0.2 s apart, in
    the order of the reply's object tree; each is sent within a few looks of landing, not with the last."""
    from flwr.supercore.inflatable.inflatable_object import get_object_tree

    state, store = flower_node()
    message, contents = reply_preregistered(store)
    order = [t.object_id for t in iterate(get_object_tree(message))]
    landed: dict[str, float] = {}

    def client_app():
        state.store_message(message)
        for oid in order:
            time.sleep(0.2)
            store.put(oid, contents[oid])
            landed[oid] = time.monotonic()

    threading.Thread(target=client_app).start()
    sent = push_with_flower(state, store)
    assert [oid for _, oid, _ in sent] == order
    assert all(0 <= at - landed[oid] < 0.15 for at, oid, _ in sent), [(at - landed[oid]) for at, oid, _ in sent]


def test_a_reply_object_that_never_comes_is_left_to_flowers_wait(monkeypatch):
    state, store = flower_node()
    message, _ = reply_preregistered(store)
    state.store_message(message)
    monkeypatch.setattr(device_supernode, "OBJECT_WAIT_S", 0.2)
    handed: list[list] = []
    looks: list[bytes] = []

    def flower_push(*, state, object_store):  # Flower's: the reply taken, then each object looked for in turn
        handed.append(state.get_messages_legacy(is_reply=True))
        looks.append(object_store.get(message.object_id))

    start = time.monotonic()
    device_supernode.fast_push(flower_push, 0.02)(state=state, object_store=store)
    assert 0.2 <= time.monotonic() - start < 1.0 and [m.object_id for m in handed[0]] == [message.object_id]
    assert looks == [b""]  # still not in: Flower's own loop waits for it from here


@pytest.mark.parametrize("flag", ["--pull-s", "--reply-poll-s"])
@pytest.mark.parametrize("bad", ["0", "-1", "nan", "61", "soon"])
def test_a_bad_interval_is_one_line_and_exit_2(flag, bad, capsys):
    status, last = cli_refusal(capsys, ["device", "supernode", flag, bad, "--", "--insecure"])
    assert status == 2 and flag in last, last


def test_flowers_flags_reach_flowers_parser():
    """Everything after ``--`` is flower-supernode's: its own parser answers a flag it does not know."""
    done = subprocess.run(
        [str(BIN / "fleet"), "device", "supernode", "--", "--no-such-flower-flag"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "flower-supernode" in done.stderr and "--no-such-flower-flag" in done.stderr
