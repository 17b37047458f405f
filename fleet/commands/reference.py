"""docs/config.md, generated from the config's dataclasses so that the reference cannot drift from the code.

Every section of :class:`~fleet.federated.shared.config.FleetConfig` (the experiment's model, data, train
and pretrain sections, and the fleet's own) and the testbed's (:class:`~fleet.testbed.config.TestbedFleetConfig`,
a section the core leaves to ``fleet testbed``) becomes a heading with its dataclass's docstring and a
table: each field's dotted path, type, default, what is allowed (the rule the loader checks: a
section's own ``RULES``, else the experiment's ``RULES`` by dotted path, see
:func:`fleet.engine.config.rule_of`) and why it is there, read from the source comment beside or
directly above the field. Regenerate with::

    python -m fleet.commands.reference > docs/config.md

``tests/test_config_reference.py`` fails when the file and :func:`render` differ.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
import typing
from typing import Any

from fleet.data import shift as shift_module
from fleet.engine.config import rule_of
from fleet.federated.shared import class_config
from fleet.federated.shared.config import MOVED, SECTIONS_ABOVE, FleetConfig
from fleet.testbed.config import TestbedFleetConfig

GENERATE = "python -m fleet.commands.reference > docs/config.md"
NO_RULE = "—"  # the loader checks the type only

INTRO = f"""\
# Config reference

<!-- Generated from the config's dataclasses by `{GENERATE}`; do not edit by hand:
tests/test_config_reference.py fails when this file and the code differ. -->

One YAML file drives `fleet simulate`, `flwr run .` and the benchmarks (examples in `simulations/`;
`simulations/fleet.yaml` is the main job's). Its top-level keys are the sections below; a section left
out keeps every default. Any field can be overridden from the command line with its dotted path:
`fleet simulate --set federation.rounds=5`, `--set devices.shift.rotation_deg=45`, `--set
robust.norm_bound=null`, and in deployment `flwr run . <connection> --run-config "federation.rounds=30"`.
`fleet train`, `fleet personalize` and `fleet pretrain` read the experiment's sections (top level,
`model`, `data`, `train`, `pretrain`) of the same kind of file.

Every field is checked when the file is loaded. A bad value stops the run with one line naming the
field, its value and what is allowed, e.g. `error: devices.tiers: [0.0] is not allowed; use a
non-empty list of slow-down factors >= 1`. In the tables, *allowed* is that rule; {NO_RULE} means only
the type is checked on load (a model or dataset name is checked when it is built). A few checks span
sections, e.g. `devices.newcomers` below `devices.num_devices`, `elastic.window_blocks` at most
`elastic.num_blocks`, `data.class_names` as long as `model.num_classes`.
"""


@dataclasses.dataclass(frozen=True)
class Section:
    """One heading of the reference: a dataclass at a dotted path (``""`` for the top level)."""

    path: str
    cls: type
    top: bool = False  # the file's top level: only its plain fields, each section has its own heading


def sections(cls: type = FleetConfig, path: str = "") -> list[Section]:
    """The top level, then every section and nested dataclass in field order, each right after its parent."""
    found = [Section(path, cls, top=not path)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = _dataclass_in(hints[f.name])
        if sub is not None:
            sub_path = f"{path}.{f.name}" if path else f.name
            found += sections(sub, sub_path + ("[]" if _is_list(hints[f.name]) else ""))
    return found


def documented() -> list[Section]:
    """The core's sections, then those a tool above it adds to the same file (the testbed's)."""
    above = [s for s in sections(TestbedFleetConfig) if s.path.split(".")[0].removesuffix("[]") in SECTIONS_ABOVE]
    return sections() + above


def own_fields(section: Section) -> list[dataclasses.Field]:
    """The fields a section's table lists: at the top level only those that are not sections themselves."""
    hints = typing.get_type_hints(section.cls)
    return [f for f in dataclasses.fields(section.cls) if not (section.top and _dataclass_in(hints[f.name]))]


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass a field holds, directly or as the items of a list; None for a plain field."""
    if _is_list(tp):
        (tp,) = typing.get_args(tp)
    return tp if dataclasses.is_dataclass(tp) else None


# ---------------------------------------------------------------- comments, read from the source


def field_comments(cls: type) -> dict[str, str]:
    """Each field's why-comment: the ``#`` comment lines directly above it plus any comment on its own lines
    (a trailing comment, or one inside a definition split over lines), read from the class that defines it."""
    comments = {}
    for f in dataclasses.fields(cls):
        owner = next(k for k in cls.__mro__ if f.name in vars(k).get("__annotations__", {}))
        comments[f.name] = _class_comments(owner).get(f.name, "")
    return comments


def _class_comments(cls: type) -> dict[str, str]:
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    (node,) = ast.parse(source).body
    found = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        line = stmt.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, by_line[line])
            line -= 1
        inside = [by_line[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in by_line]
        found[stmt.target.id] = " ".join(text for text in above + inside if text)
    return found


# ---------------------------------------------------------------- rules, types and defaults


def _inline_rules(check: Any, cls: type) -> dict[str, str]:
    """What a check function allows per field, where it lists ``("field", condition, "allowed")`` tuples
    (:func:`fleet.federated.shared.class_config.check_classes` checks a device class this way)."""
    names = {f.name for f in dataclasses.fields(cls)}
    rules = {}
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(check)))):
        if isinstance(node, ast.Tuple) and len(node.elts) == 3:
            name, _, allowed = node.elts
            if (
                isinstance(name, ast.Constant)
                and name.value in names
                and isinstance(allowed, ast.Constant)
                and isinstance(allowed.value, str)
            ):
                rules[name.value] = allowed.value
    return rules


def allowed(cls: type, name: str, path: str) -> str:
    """What the loader allows for a field: its rule's text, or :data:`NO_RULE` when only its type is checked."""
    if cls is shift_module.ShiftConfig:  # the shift's rules live beside it, by field name
        rule = shift_module.RULES.get(name)
        return rule[1] if rule is not None else NO_RULE
    if cls is class_config.DeviceClassConfig:
        return _inline_rules(class_config.check_classes, cls).get(name, NO_RULE)
    rule = rule_of(cls, name, path.replace("[]", ""))
    return rule[1] if rule is not None else NO_RULE


_TYPE_NAMES = {int: "integer", float: "number", bool: "true/false", str: "string"}


def type_name(tp: Any) -> str:
    """A field's type as YAML sees it: ``number or null``, ``list of integers``, ``section``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        null = type(None) in typing.get_args(tp)
        return " or ".join(options + (["null"] if null else []))
    if _is_list(tp):
        (item,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item):
            return "list of mappings"
        name = _TYPE_NAMES.get(item, getattr(item, "__name__", str(item)))
        return f"list of {name}s"
    if dataclasses.is_dataclass(tp):
        return "section"
    return _TYPE_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def yaml_value(value: Any) -> str:
    """A default as it would be written in the YAML file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "(below)"
    return str(value)


def default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return yaml_value(value)


# ---------------------------------------------------------------- the document


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else " "


def _anchor(path: str) -> str:
    """GitHub's anchor for a heading: lower case, spaces to hyphens, other punctuation dropped."""
    return "".join(c for c in path.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def _heading(section: Section) -> str:
    return "Top level" if section.top else f"`{section.path}`"


def render_section(section: Section) -> str:
    """One section: its heading, its docstring and a table of its fields."""
    hints = typing.get_type_hints(section.cls)
    comments = field_comments(section.cls)
    doc = inspect.cleandoc(section.cls.__doc__ or "")
    level = "##" if section.top or "." not in section.path else "###"
    out = [f"{level} {_heading(section)}", "", doc, ""]
    if section.top:
        out += ["The file's own fields; every other key is one of the sections below.", ""]
    out += ["| field | type | default | allowed | why |", "|---|---|---|---|---|"]
    for f in own_fields(section):
        path = f"{section.path}.{f.name}" if section.path else f.name
        sub = _dataclass_in(hints[f.name])
        if sub is not None:
            dotted = path + ("[]" if _is_list(hints[f.name]) else "")
            shown = f"[`{path}`](#{_anchor(dotted)})"
        else:
            shown = f"`{path}`"
        row = (
            shown,
            type_name(hints[f.name]),
            f"`{default(f)}`",
            allowed(section.cls, f.name, path),
            comments[f.name],
        )
        out.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(out) + "\n"


def _contents(found: list[Section]) -> str:
    out = ["Sections:", ""]
    for section in found:
        indent = "  " * section.path.count(".")
        first = inspect.cleandoc(section.cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        out.append(f"{indent}- [{_heading(section)}](#{_anchor(_heading(section))}): {first}")
    return "\n".join(out) + "\n"


def _moved() -> str:
    out = [
        "## Fields that moved",
        "",
        "The `federation` section once held every fleet field, and `train` the device's threads, profile and "
        "memory. A field that moved is refused where it was, with one line naming its new place (e.g. "
        "`federation.personal: moved to personalization.policy`):",
        "",
        "| old | new |",
        "|---|---|",
    ]
    out += [f"| `{old}` | `{new}` |" for old, new in MOVED.items()]
    return "\n".join(out) + "\n"


def render() -> str:
    """docs/config.md."""
    found = documented()
    parts = [INTRO, _contents(found)] + [render_section(s) for s in found] + [_moved()]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
