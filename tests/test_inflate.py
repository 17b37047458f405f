"""An array is rebuilt from its chunks with one copy, and Flower's checks still refuse what they refused
(server.inflate)."""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest
from flwr.app import Array
from flwr.app.message.arraychunk import ArrayChunk
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

from server.inflate import lean_inflate

FLOWER_API = {
    "flwr.app.message.array": ("Array", "inflate"),
    "flwr.app.message.arraychunk": ("ArrayChunk", "inflate"),
    "flwr.supercore.inflatable.inflatable_object": ("get_object_type_from_object_content", None),
}


def test_the_flower_internals_lean_inflate_replaces_are_there():
    """A Flower upgrade that moves, renames or reshapes them fails here, in one line."""
    for module_name, (name, method) in FLOWER_API.items():
        module = importlib.import_module(module_name)
        assert hasattr(module, name), f"flwr changed: {module_name}.{name} is gone (server.inflate uses it)"
        if method is not None:
            params = list(inspect.signature(getattr(getattr(module, name), method)).parameters)
            assert params == ["object_content", "children"], f"flwr changed: {name}.{method} takes {params}"
    from flwr.supercore.inflatable import inflatable_object

    for helper in ("HEAD_BODY_DIVIDER", "get_object_body", "get_object_children_ids_from_object_content"):
        assert hasattr(inflatable_object, helper), f"flwr changed: inflatable_object.{helper} is gone"


def contents_of(array: Array) -> dict[str, bytes]:
    """Every object of ``array`` as it crosses the network (the array and its chunks): id -> content."""
    return {object_id: obj.deflate() for object_id, obj in get_all_nested_objects(array).items()}


@pytest.mark.parametrize("values", [np.arange(3_000_000, dtype=np.float32), np.zeros(3_000_000, np.float32)])
def test_an_array_comes_back_whole_from_its_chunks(values):
    """12 MB: three chunks of Flower's 5 MB, two of them one object where the values repeat (zeros)."""
    sent = Array(values)
    contents = contents_of(sent)
    lean_inflate()
    back = inflate_object_from_contents(sent.object_id, contents)
    assert isinstance(back.data, bytes) and back.data == sent.data
    np.testing.assert_array_equal(back.numpy(), values)


@pytest.fixture
def contents() -> dict[str, bytes]:
    return contents_of(Array(np.arange(3_000_000, dtype=np.float32)))


def test_a_chunk_is_a_view_of_its_content_not_a_copy(contents):
    lean_inflate()
    content = next(c for c in contents.values() if c.startswith(b"ArrayChunk "))
    chunk = ArrayChunk.inflate(content)
    assert chunk.data.obj is content
    assert bytes(chunk.data) == content[content.index(b"\x00") + 1 :]


def test_flowers_checks_still_refuse(contents):
    lean_inflate()
    chunk_content = next(c for c in contents.values() if c.startswith(b"ArrayChunk "))
    array_content = next(c for c in contents.values() if c.startswith(b"Array "))
    with pytest.raises(ValueError, match="do not match"):
        ArrayChunk.inflate(array_content)  # another type's content
    with pytest.raises(ValueError, match="do not match"):
        Array.inflate(chunk_content, {})
    with pytest.raises(ValueError, match="do not have children"):
        ArrayChunk.inflate(chunk_content, {"x": ArrayChunk.inflate(chunk_content)})
    with pytest.raises(ValueError, match="Unexpected set of `children`"):
        Array.inflate(array_content, {"not-its-chunk": ArrayChunk.inflate(chunk_content)})
