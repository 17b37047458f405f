"""Reading a pickle of plain data that a stranger wrote, without building what it claims first.

The C unpickler trusts a pickle's numbers: a 14-byte file that declares a 1 TiB bytes object has that much
allocated before a byte of it is read; 1,000,000 nested one-item tuples, used as a dict key, are hashed by a
C recursion that overflows the stack and kills the process (no exception to catch); and a 5,000-digit
integer is built whole, then crashes whatever writes it as text. So :func:`pickle_problem` walks the file's
opcodes first, by :mod:`pickletools`' table of each one's argument and stack effect: a declared length is
read as a number and checked against the bytes left, and the unpickler's stack is followed as nesting
depths alone, so nothing the file declares is built. Only a file that passes reaches the unpickler, still
:class:`DataOnly`, which refuses every class and function a pickle names.

Design notes:

* **Bounds from the data.** A declared length may not pass the file's end; nesting stops at
  :data:`MAX_DEPTH`, as for YAML (fleet/engine/yaml_text.py); an integer may not be wider than a float
  holds (:data:`MAX_INT_BITS`), since a measurement is read as a float and a wider one is no measurement.
* **Depth of what is shared.** A list or dict memoized and then filled is remembered at its depth when it
  was memoized, so depths reached through a memo reference can be undercounted; the nesting that crashes
  (hashing, an immutable tuple's or frozenset's) is built from its items, so it is counted exactly.
* **Bytes built.** A 1-byte opcode can build a 216-byte set, so a file under the trace's size bound could still
  build tens of GB of empty containers. The walk adds up about what each object it would build costs (its
  ``sys.getsizeof`` when empty, 32 bytes and its argument for a scalar, a slot per item it holds) and stops at
  :data:`MAX_BUILT_BYTES`.
* **Cost.** Walking the opcodes in Python costs about 3 s per 40 MB of trace on top of the C load's 1 s
  (one opcode at a time, with no object built); each process reads a trace once.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import sys
from typing import Any

MAX_DEPTH = 64  # a FedScale trace is 3 deep
MAX_INT_BITS = 1024  # the widest integer a float holds (about 1.8e308)
MAX_INT_DIGITS = 309  # the same as decimal digits, for JSON
# about what the objects a file builds may cost: FedScale's 60 MB behaviour file builds about 0.6 GB
MAX_BUILT_BYTES = 2 * 2**30
SCALAR_BYTES = 32  # about a number's or a string's own cost, besides its text
_EMPTY_BYTES = {  # what an opcode that builds a container costs before its items
    **dict.fromkeys(("EMPTY_DICT", "DICT"), sys.getsizeof({})),
    **dict.fromkeys(("EMPTY_LIST", "LIST"), sys.getsizeof([])),
    **dict.fromkeys(("EMPTY_SET", "FROZENSET"), sys.getsizeof(set())),
    "EMPTY_TUPLE": 0,  # one shared object
}

_FILLS = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"})  # add to the container below
_DROPS = frozenset({"DUP", "POP", "POP_MARK"})  # build nothing and hold nothing new
_NUMBERS = frozenset({"INT", "LONG", "LONG1", "LONG4"})  # the opcodes an integer of any width comes in
MARK, PUT, MEMOIZE, GET, STOP, FRAME, SCALAR, NOTHING, OTHER = range(9)  # what an opcode does to the stack


class DataOnly(pickle.Unpickler):
    """Unpickles plain data only: any class or function a pickle names is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}, and only dicts, lists, numbers and strings are read")


_NAMED = {  # the opcodes the walk follows by name
    "MARK": MARK,
    "MEMOIZE": MEMOIZE,
    "STOP": STOP,
    "FRAME": FRAME,
    **dict.fromkeys(("PUT", "BINPUT", "LONG_BINPUT"), PUT),
    **dict.fromkeys(("GET", "BINGET", "LONG_BINGET"), GET),
}


def _plan(op: pickletools.OpcodeInfo) -> tuple[int, int, int, int]:
    """(kind, fixed, width, lines) of an opcode: what it does to the stack, then its argument's extent: a fixed
    number of bytes, or a count ``width`` bytes wide (negative: signed) and that many bytes, or ``lines``
    newline-ended lines. Read from :mod:`pickletools`' table, the one the C unpickler is documented by."""
    n = op.arg.n if op.arg is not None else 0
    if n >= 0:
        fixed, width, lines = n, 0, 0
    elif n == pickletools.UP_TO_NEWLINE:
        fixed, width, lines = 0, 0, 2 if op.arg.name == "stringnl_noescape_pair" else 1
    else:
        fixed, lines = 0, 0
        width = {
            pickletools.TAKEN_FROM_ARGUMENT1: 1,
            pickletools.TAKEN_FROM_ARGUMENT4: -4,
            pickletools.TAKEN_FROM_ARGUMENT4U: 4,
            pickletools.TAKEN_FROM_ARGUMENT8U: 8,
        }[n]
    kind = _NAMED.get(op.name)
    if kind is None and not op.stack_before and not op.name.startswith("EMPTY_") and op.name not in _NUMBERS:
        kind = SCALAR if len(op.stack_after) == 1 else NOTHING if not op.stack_after else OTHER
    return kind if kind is not None else OTHER, fixed, width, lines


_PLANS = {ord(op.code): (op, *_plan(op)) for op in pickletools.opcodes}


def _consume(op: pickletools.OpcodeInfo, stack: list[int], marks: list[int]) -> list[int] | None:
    """Take off ``stack`` the depths of the objects ``op`` consumes (up to its mark, if it takes one); None
    when the stack holds fewer than it takes, a malformed pickle."""
    before = op.stack_before
    if pickletools.markobject in before:
        below = before.index(pickletools.markobject)
        if not marks or marks[-1] < below:
            return None
        start = marks.pop() - below
    elif len(stack) < len(before):
        return None
    else:
        start = len(stack) - len(before)
    taken = stack[start:]
    del stack[start:]
    return taken


def _depth(name: str, taken: list[int]) -> int:
    """The nesting depth of what an opcode pushes, from the depths of what it took: 0 for a number or string,
    1 for an empty container, one more than its deepest item for a container built or filled."""
    if not taken:
        return 1 if name.startswith("EMPTY_") else 0
    if name == "DUP":
        return taken[0]
    if name in _FILLS:
        return max(taken[0], 1 + max(taken[1:], default=0))
    return 1 + max(taken)


def _extent(data: bytes, i: int, fixed: int, width: int, lines: int) -> int:
    """Where the argument starting at ``i`` ends; ValueError when it would pass the end of ``data``."""
    if width:
        begin = i + abs(width)  # where the counted bytes begin
        count = int.from_bytes(data[i:begin], "little", signed=width < 0)
        if begin > len(data) or count < 0 or begin + count > len(data):
            raise ValueError(
                f"it declares {count:,} bytes at offset {i - 1:,}, where {max(len(data) - begin, 0):,} remain"
            )
        return begin + count
    for _ in range(lines):
        i = data.find(b"\n", i)
        if i < 0:
            raise ValueError("it is cut short (a line without its end)")
        i += 1
    if i + fixed > len(data):
        raise ValueError("it is cut short")
    return i + fixed


def _check_frame(data: bytes, start: int, end: int) -> None:
    """A FRAME's declared length, within the bytes left after it (its opcodes are then read one by one)."""
    length = int.from_bytes(data[start:end], "little")
    if length > len(data) - end:
        raise ValueError(
            f"it declares a frame of {length:,} bytes at offset {start - 1:,}, where {len(data) - end:,} remain"
        )


def _memo_key(data: bytes, start: int, end: int, lines: int) -> int:
    """The memo index an opcode's argument names (a decimal line, or little-endian bytes)."""
    return int(data[start : end - 1]) if lines else int.from_bytes(data[start:end], "little")


def _integer_problem(name: str, arg: bytes) -> str | None:
    """Why an integer opcode's argument is wider than a float holds (no measurement is), or None: LONG1 and
    LONG4 count bytes of two's complement, INT and LONG (protocol 0) write decimal digits."""
    if name in ("LONG1", "LONG4"):
        width = len(arg) - (1 if name == "LONG1" else 4)
        return (
            None if width <= MAX_INT_BITS // 8 + 1 else f"it holds an integer of {width:,} bytes, wider than any float"
        )
    digits = len(arg.strip().rstrip(b"L").lstrip(b"+-"))
    return None if digits <= MAX_INT_DIGITS else f"it holds an integer of {digits:,} digits, wider than any float"


def _other(op: pickletools.OpcodeInfo, arg: bytes, stack: list[int], marks: list[int]) -> tuple[str | None, int]:
    """An opcode that builds, fills or drops objects, or reads an integer of any width: why it is refused, or
    None, and about the bytes of what it builds (its own object's, and a slot per item it takes in)."""
    if op.name in _NUMBERS:
        problem = _integer_problem(op.name, arg)
        if problem is not None:
            return problem, 0
    taken = _consume(op, stack, marks)
    if taken is None:
        return f"it is malformed ({op.name} takes more than the stack holds)", 0
    depth = _depth(op.name, taken)
    if depth > MAX_DEPTH:
        return f"it is nested more than {MAX_DEPTH} levels deep", 0
    stack.extend([depth] * len(op.stack_after))
    if op.name in _DROPS:
        return None, 0
    own = 0 if op.name in _FILLS or not op.stack_after else _EMPTY_BYTES.get(op.name, SCALAR_BYTES + len(arg))
    return None, own + 8 * len(taken)  # a slot for each item it holds


def pickle_problem(data: bytes) -> str | None:
    """Why ``data`` must not reach the unpickler (a length past its end, nesting past :data:`MAX_DEPTH`, an
    integer past :data:`MAX_INT_BITS`, a malformed opcode), or None; nothing it declares is built."""
    stack: list[int] = []  # the depth of each object the unpickler would hold, bottom first
    marks: list[int] = []  # the stack's length at each MARK still open
    memo: dict[int, int] = {}
    i, size, plans, built = 0, len(data), _PLANS, 0
    try:
        while i < size:
            plan = plans.get(data[i])
            if plan is None:
                return f"it is malformed (unknown opcode {data[i]:#04x} at offset {i:,})"
            op, kind, fixed, width, lines = plan
            start = i + 1
            i = start + fixed if not (width or lines) and start + fixed <= size else _extent(data, start, *plan[2:])
            if kind == SCALAR:
                stack.append(0)
                built += SCALAR_BYTES + i - start
            elif kind == MARK:
                marks.append(len(stack))
            elif kind == GET:
                stack.append(memo.get(_memo_key(data, start, i, lines), 0))
            elif kind in (PUT, MEMOIZE):
                if not stack:
                    return f"it is malformed ({op.name} with nothing to remember)"
                memo[_memo_key(data, start, i, lines) if kind == PUT else len(memo)] = stack[-1]
            elif kind == STOP:
                return None if stack else "it is malformed (STOP with nothing to return)"
            elif kind == FRAME:
                _check_frame(data, start, i)
            elif kind == OTHER:
                problem, cost = _other(op, data[start:i], stack, marks)
                if problem is not None:
                    return problem
                built += cost
            if built > MAX_BUILT_BYTES:
                return f"it would build more than {MAX_BUILT_BYTES / 2**30:g} GB of objects (by offset {i:,})"
    except ValueError as exc:  # a declared length past the end, a memo index that is no number
        return str(exc) if str(exc).startswith("it ") else f"it is malformed ({str(exc)[:100]})"
    return "it is cut short (no STOP opcode)"


def load_plain(data: bytes) -> Any:
    """``data`` unpickled as plain data, once :func:`pickle_problem` passed it; ``pickle.UnpicklingError``
    naming the problem otherwise."""
    problem = pickle_problem(data)
    if problem is not None:
        raise pickle.UnpicklingError(problem)
    return DataOnly(io.BytesIO(data)).load()


def json_int(text: str) -> int:
    """JSON's integer ``text``, refused past a float's width as a pickle's is (``json.load``'s ``parse_int``)."""
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"it holds an integer of {len(text.lstrip('-'))} digits, wider than any float")
    return int(text)
