"""docs/config.md is generated from the config's dataclasses, and the sections stay small and commented."""

import dataclasses
from pathlib import Path

import pytest

from fleet.base.errors import ConfigError
from fleet.commands import reference
from fleet.federated.shared.config import MOVED, SECTIONS, FleetConfig, fleet_config_from_dict

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"
MAX_FIELDS = 15


def test_doc_is_generated_from_the_code():
    assert DOC.read_text(encoding="utf-8") == reference.render(), (
        f"docs/config.md differs from the config's dataclasses; regenerate it: {reference.GENERATE}"
    )


def test_every_section_is_in_the_reference():
    paths = [s.path for s in reference.documented()]
    assert set(SECTIONS) | {"model", "data", "train", "hardware", "pretrain"} <= set(paths)
    assert {"data.shift", "devices.shift", "devices.device_classes[]", "testbed", "testbed.classes[]"} <= set(paths)
    text = reference.render()
    for section in reference.documented():
        for f in reference.own_fields(section):
            path = f"{section.path}.{f.name}" if section.path else f.name
            assert f"`{path}`" in text


@pytest.mark.parametrize("section", reference.documented(), ids=lambda s: s.path or "top")
def test_every_field_says_why(section):
    comments = reference.field_comments(section.cls)
    missing = [f.name for f in reference.own_fields(section) if not comments[f.name].strip()]
    assert not missing, (
        f"{section.cls.__name__}: give these fields a `# why` comment beside or above them: {', '.join(missing)}"
    )
    doc = section.cls.__doc__ or ""
    assert doc.strip() and not doc.startswith(section.cls.__name__ + "("), (
        f"{section.cls.__name__} needs a docstring: it heads its section in docs/config.md"
    )


@pytest.mark.parametrize("section", reference.documented()[1:], ids=lambda s: s.path)
def test_sections_stay_small(section):
    count = len(dataclasses.fields(section.cls))
    limit = MAX_FIELDS
    assert count <= limit, f"{section.path} has {count} fields (at most {limit}); split it into sections"


def test_fleet_sections_are_sections_of_the_reference():
    assert SECTIONS == tuple(s.path for s in reference.sections() if s.path in SECTIONS)


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_moved_field_names_its_new_place(old, new):
    with pytest.raises(ConfigError) as info:
        section, field = old.split(".")
        fleet_config_from_dict({section: {field: None}})
    assert str(info.value).startswith(f"{old}: moved to {new};")
    section, name = new.split(".")
    assert name in {f.name for f in dataclasses.fields(getattr(FleetConfig(), section))}


def test_personal_moved_to_personalization_policy():
    with pytest.raises(ConfigError, match=r"personalization\.policy"):
        fleet_config_from_dict({"federation": {"personal": "head"}})


@dataclasses.dataclass
class Demo:
    """A section for the reader's tests."""

    plain: int = 1  # a trailing comment
    # a comment above,
    # on two lines
    above: str = "x"
    split: tuple[int, ...] = (
        1,
        2,  # a comment inside a definition over several lines
    )
    listed: list[float] = dataclasses.field(
        default_factory=lambda: [1.0, 2.0],
    )  # a comment after the closing bracket
    # a comment that a blank line keeps from the field

    not_above: float | None = None


def test_comments_are_read_from_the_source():
    assert reference.field_comments(Demo) == {
        "plain": "a trailing comment",
        "above": "a comment above, on two lines",
        "split": "a comment inside a definition over several lines",
        "listed": "a comment after the closing bracket",
        "not_above": "",
    }


def test_a_section_renders_its_fields():
    text = reference.render_section(reference.Section("demo", Demo))
    assert text.startswith("## `demo`\n\nA section for the reader's tests.\n")
    assert "| `demo.listed` | list of numbers | `[1.0, 2.0]` | — | a comment after the closing bracket |" in text
    assert "| `demo.not_above` | number or null | `null` | — |   |" in text


def test_a_changed_comment_fails_the_drift_check(monkeypatch):
    """The drift check can fail: a comment changed in the code changes what render() writes."""
    real = reference.field_comments

    def changed(cls):
        comments = real(cls)
        if "rounds" in comments:
            comments["rounds"] = "a changed comment"
        return comments

    monkeypatch.setattr(reference, "field_comments", changed)
    text = reference.render()
    assert "a changed comment" in text
    assert text != DOC.read_text(encoding="utf-8")


def test_a_moved_field_in_a_saved_runs_file_names_that_file_not_set(tmp_path):
    from fleet.federated.shared.config import load_fleet_config

    saved = tmp_path / "fleet-config.yaml"
    saved.write_text("train:\n  threads: 2\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(str(saved))
    message = str(info.value)
    assert message.startswith(f"config file {saved}: train.threads: moved to hardware.threads; in that file")
    assert "--set" not in message
    with pytest.raises(ConfigError, match=r"^train.threads: moved to hardware.threads; write --set hardware.threads="):
        load_fleet_config(None, {"train.threads": 2})
