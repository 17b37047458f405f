"""The one YAML reader for every file a user or a device hands fleet: configs, traces, profiles, ``--set``.

Design notes:

* **Duplicate keys are errors.** PyYAML keeps the last of two ``data:`` keys silently, so a file's first
  section vanished and the error named a field the user had in fact written. The loader refuses the second,
  with its line.
* **Bounded size once expanded.** Aliases let a few hundred bytes stand for a value of billions of nodes
  (the "billion laughs"): PyYAML builds it cheaply, as shared objects, but whatever walks it afterwards
  (validation, an error message quoting the value) expands it until memory runs out. The loaded value is
  walked once, aliases counted as often as they are used, and refused past :data:`MAX_NODES` or
  :data:`MAX_DEPTH`, the largest real file being a profile of a few thousand nodes.
* **Deep nesting is an error, not a crash.** 5,000 nested brackets exhaust Python's recursion in the
  parser; that RecursionError becomes the same error as any other malformed file.
* **libyaml's parser where PyYAML has it.** A deployed device parses its profile and its config in every
  message's new process; PyYAML's pure-Python parser took 31 ms of a 10 KB profile, libyaml's 4 ms (the same
  values), and at a fifth of a core that difference is a seventh of a second of every round. libyaml refuses
  more than 1,000 nesting levels itself; that is reported as any nesting beyond :data:`MAX_DEPTH`.

Every problem is raised as a ``yaml.YAMLError`` with a ``problem`` (and, where known, a ``problem_mark``), so
the callers' one-line messages for malformed YAML cover these too.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_NODES = 200_000  # values, keys and items once aliases are expanded: far above any real config or profile
MAX_DEPTH = 64  # nesting: a config is 3-4 deep, a profile 4


class YamlRefused(yaml.YAMLError):
    """A well-formed YAML text fleet will not read (duplicate keys, too large once expanded, too deep)."""

    def __init__(self, problem: str, problem_mark: Any = None) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, problem_mark


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, when PyYAML was built with it


class _StrictLoader(_SAFE_LOADER):
    """PyYAML's safe loader that refuses a mapping's repeated key."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise YamlRefused(
                        f"duplicate key {key!r} (the second would silently replace the first)", key_node.start_mark
                    )
                seen.add(key)
            except TypeError:  # an unhashable key: PyYAML refuses it itself
                pass
        return super().construct_mapping(node, deep)


def _check_size(value: Any) -> None:
    """Walk ``value`` as its users will (each alias as often as it is used), refusing it past the bounds."""
    stack, count = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise YamlRefused(f"more than {MAX_NODES:,} values once its aliases (*name) are expanded")
        if depth > MAX_DEPTH:
            raise YamlRefused(f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for kv in item.items() for v in kv)
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def load_yaml(text: str) -> Any:
    """``text`` as YAML's plain data (as ``yaml.safe_load``), within the bounds above; a ``yaml.YAMLError``
    for anything malformed or refused."""
    try:
        value = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a safe loader's subclass)
    except RecursionError:
        raise YamlRefused(f"nested more than {MAX_DEPTH} levels deep") from None
    except yaml.MarkedYAMLError as exc:
        if "maximum nesting depth" not in str(exc.problem):
            raise
        raise YamlRefused(f"nested more than {MAX_DEPTH} levels deep", exc.problem_mark) from None  # libyaml's bound
    _check_size(value)
    return value
