"""Flower's inflation of an array from its chunks, with one copy of its bytes instead of three.

A message's array crosses the network as 5 MB chunks (Flower's ``ArrayChunk`` objects), each a header and a
body. To rebuild the array, Flower slices each chunk's body out of its content (a copy), appends the bodies to
a growing ``bytearray`` (a copy, with the reallocations), and turns that into ``bytes`` (a copy). On a testbed
pi4 at a fifth of a core that was 0.35-0.45 s of every 22 MB message's wall time, on the device (the global
model) and on the server (each reply).

Design notes:

* **A view, then one join.** A chunk's body is a ``memoryview`` of its content, and the array's bytes one
  ``b"".join`` of those views: the one copy that makes the array's own ``bytes``.
* **Flower's checks, kept.** The content's type must name the class, a chunk has no children, and the
  array's listed chunks must be exactly the children handed in, as in Flower's own ``inflate``; the array's
  header and body are read by Flower's own helpers, and only a chunk's body-as-a-view repeats its type check.
  Each object's content was checked against its SHA-256 id before, as ever.
* **Where.** The ServerApp (``server.server_app``) and each task of ``fleet device runtime`` replace the two
  class methods at start; nothing else changes. Flower internals (flwr pinned: pyproject.toml);
  ``tests/test_inflate.py`` names the missing one if they change.
"""

from __future__ import annotations

import json
from typing import Any


def lean_inflate() -> None:
    """Flower's ``Array.inflate`` and ``ArrayChunk.inflate`` replaced by the ones here (design notes)."""
    from flwr.app.message.array import Array
    from flwr.app.message.arraychunk import ArrayChunk

    ArrayChunk.inflate = classmethod(_inflate_chunk)
    Array.inflate = classmethod(_inflate_array)


def _body(object_content: bytes, cls: type) -> memoryview:
    """``object_content``'s body as a view, once its header names ``cls`` (Flower's ``get_object_body``'s check)."""
    from flwr.supercore.inflatable.inflatable_object import HEAD_BODY_DIVIDER, get_object_type_from_object_content

    object_type = get_object_type_from_object_content(object_content)
    if object_type != cls.__qualname__:
        raise ValueError(f"Class name ({cls.__qualname__}) and object type ({object_type}) do not match.")
    return memoryview(object_content)[object_content.find(HEAD_BODY_DIVIDER) + len(HEAD_BODY_DIVIDER) :]


def _inflate_chunk(cls: type, object_content: bytes, children: dict[str, Any] | None = None) -> Any:
    if children:
        raise ValueError("`ArrayChunk` objects do not have children.")
    return cls(data=_body(object_content, cls))


def _inflate_array(cls: type, object_content: bytes, children: dict[str, Any] | None = None) -> Any:
    from flwr.supercore.inflatable.inflatable_object import (
        get_object_body,
        get_object_children_ids_from_object_content,
    )

    children = children or {}
    meta = json.loads(get_object_body(object_content, cls).decode("utf-8"))  # a few hundred bytes: copied
    ids = get_object_children_ids_from_object_content(object_content)
    chunk_ids = [ids[i] for i in meta["arraychunk_ids"]]
    if set(chunk_ids) != set(children):
        raise ValueError(f"Unexpected set of `children`. Expected {set(chunk_ids)} but got {set(children)}.")
    array = cls(dtype=meta["dtype"], shape=tuple(meta["shape"]), stype=meta["stype"], data=b"")
    array.data = b"".join(children[i].data for i in chunk_ids)
    return array
