"""A stranger's pickle of plain data: every honest protocol reads back as written, and what a file claims
(a length, a nesting, an integer's width) is bounded before anything it declares is built."""

from __future__ import annotations

import pickle
import sys
import tracemalloc

import pytest

import fleet.federated.shared.plain_pickle as plain
from fleet.federated.shared.plain_pickle import MAX_DEPTH, load_plain, pickle_problem

HONEST = {
    1: {"computation": 153.5, "communication": 8000, "model": "SM-G960F\nline two", "none": None, "yes": True},
    -7: {"active": [0, 255, 65_535, 2**31, -(2**40)], "inactive": (1.5, -0.0, float("inf")), "shared": None},
    "nested": [[[[[[[[[[1]]]]]]]]]],
    (1, (2, (3,))): ("a", "b"),
    "widest": 2**1023,  # still a float's width
}
HONEST["shared"] = HONEST["nested"]  # a memo reference, read back as the same object


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_protocol_reads_back_as_written(protocol):
    data = dict(HONEST)  # older protocols pickle bytes (below 3) and sets (below 4) by a call, which is refused
    if protocol >= 3:
        data["bytes"] = b"\x00\n" * 300
    if protocol >= 4:
        data.update(set={3, 4}, frozen={frozenset({1, 2}): 1})
    assert pickle_problem(pickle.dumps(data, protocol)) is None
    loaded = load_plain(pickle.dumps(data, protocol))
    assert loaded == data and loaded["shared"] is loaded["nested"]


def _claim(opcode: bytes, width: int, count: int) -> bytes:
    """Protocol 4, one counted opcode declaring ``count`` bytes, and nothing after it."""
    return b"\x80\x04" + opcode + count.to_bytes(width, "little") + b"."


@pytest.mark.parametrize(
    "data",
    [
        _claim(b"\x8e", 8, 2**40),  # BINBYTES8: 1 TiB in 14 bytes
        _claim(b"\x96", 8, 2**40),  # BYTEARRAY8
        _claim(b"\x8d", 8, 2**40),  # BINUNICODE8
        _claim(b"B", 4, 2**32 - 1),  # BINBYTES: 4 GiB
        _claim(b"X", 4, 2**32 - 1),  # BINUNICODE
        _claim(b"\x8b", 4, 2**31 - 1),  # LONG4: a 2 GiB integer
        b"\x80\x04\x95" + (2**40).to_bytes(8, "little") + b".",  # FRAME: only skipped, the opcodes in it read
    ],
    ids=["bytes8", "bytearray8", "unicode8", "bytes4", "unicode4", "long4", "frame"],
)
def test_a_length_past_the_end_is_refused_without_allocating_it(data):
    tracemalloc.start()
    try:
        with pytest.raises(
            pickle.UnpicklingError, match=r"declares (a frame of )?[\d,]+ bytes at offset 2, where 1 remain"
        ):
            load_plain(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # the C unpickler asked for the whole declared size first


def test_a_frame_that_fits_is_read_through():
    assert load_plain(b"\x80\x04\x95" + (2).to_bytes(8, "little") + b"N.") is None


def test_a_million_nested_tuples_are_refused_not_hashed():
    """As a dict key they were hashed by C recursion: the process died of a segmentation fault."""
    data = b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"Ns."
    with pytest.raises(pickle.UnpicklingError, match=f"nested more than {MAX_DEPTH} levels deep"):
        load_plain(data)


def test_nesting_built_through_the_memo_is_counted():
    """Each level remembered (MEMOIZE), dropped (POP) and fetched back (LONG_BINGET) before the next wraps it."""
    steps = b"".join(b"\x85\x94" + b"0" + b"j" + k.to_bytes(4, "little") for k in range(MAX_DEPTH + 1))
    with pytest.raises(pickle.UnpicklingError, match="nested more than"):
        load_plain(b"\x80\x04)" + steps + b".")
    assert load_plain(b"\x80\x04)" + steps[: 7 * (MAX_DEPTH - 1)] + b".") is not None  # 63 levels: read


@pytest.mark.parametrize(
    "data, message",
    [
        (pickle.dumps(10**400, 4), "integer of 167 bytes, wider than any float"),
        (pickle.dumps({10**5000: 1}, 4), "integer of 2,077 bytes"),  # as a key: str() of it raised ValueError
        (b"I" + b"9" * 400 + b"\n.", "integer of 400 digits"),  # protocol 0's decimal forms
        (b"L-" + b"9" * 400 + b"L\n.", "integer of 400 digits"),
    ],
    ids=["long1", "long-key", "int-text", "long-text"],
)
def test_an_integer_wider_than_a_float_is_refused(data, message):
    with pytest.raises(pickle.UnpicklingError, match=message):
        load_plain(data)


@pytest.mark.parametrize(
    "data, message",
    [
        (pickle.dumps([1, 2], 4)[:-3], "a frame of 9 bytes at offset 2, where 6 remain"),
        (pickle.dumps([1, 2], 2)[:-3], "cut short"),
        (b"\x80\x04N", "no STOP opcode"),
        (b"\x80\x04\xff.", "unknown opcode 0xff at offset 2"),
        (b"\x80\x04Na.", "APPEND takes more than the stack holds"),
        (b"\x80\x04e.", "APPENDS takes more than the stack holds"),
        (b"\x80\x04.", "STOP with nothing to return"),
        (b"\x80\x04\x94.", "MEMOIZE with nothing to remember"),
        (b"\x80\x04gx\n.", "malformed"),  # a memo index that is no number
    ],
    ids=[
        "truncated-frame",
        "truncated",
        "no-stop",
        "unknown-opcode",
        "append",
        "appends",
        "stop",
        "memoize",
        "get-text",
    ],
)
def test_a_malformed_pickle_is_named_in_one_line(data, message):
    with pytest.raises(pickle.UnpicklingError, match=message) as err:
        load_plain(data)
    assert "\n" not in str(err.value)


def test_a_named_callable_is_still_refused_after_the_walk():
    with pytest.raises(pickle.UnpicklingError, match=r"it names builtins.print, and only dicts"):
        load_plain(pickle.dumps(print, 4))


def test_empty_containers_past_the_built_bound_are_refused_before_any_is_built(monkeypatch):
    """One byte an empty set: 10 MB of them would build 2.2 GB, under the trace files' size bound. The bound is
    lowered here, so the walk stops after 10,000 of them and nothing of them is built."""
    monkeypatch.setattr(plain, "MAX_BUILT_BYTES", 10_000 * 224)
    sets = b"\x80\x04](" + b"\x8f" * 20_000 + b"e."  # a list, a mark, 20,000 EMPTY_SETs, APPENDS
    with pytest.raises(pickle.UnpicklingError, match="would build more than"):
        load_plain(sets)
    assert len(load_plain(b"\x80\x04](" + b"\x8f" * 5_000 + b"e.")) == 5_000  # half the bound: read


def test_what_a_trace_builds_is_estimated_near_what_python_builds(monkeypatch):
    """The bound must not refuse an honest trace: a dict of lists of floats, as FedScale's behaviour file."""
    trace = {f"client-{i}": {"active": [float(t) for t in range(50)], "inactive": [1.5] * 50} for i in range(2_000)}
    real = sys.getsizeof(trace) + sum(
        sys.getsizeof(k) + sys.getsizeof(v) + sum(sys.getsizeof(x) + sum(map(sys.getsizeof, x)) for x in v.values())
        for k, v in trace.items()
    )
    data = pickle.dumps(trace, protocol=4)
    assert pickle_problem(data) is None
    monkeypatch.setattr(plain, "MAX_BUILT_BYTES", 2 * real)  # the estimate stays within twice what is built
    assert pickle_problem(data) is None
    monkeypatch.setattr(plain, "MAX_BUILT_BYTES", real // 2)  # ... and above half of it
    assert "would build more than" in pickle_problem(data)
