"""A message's tensors cross as one buffer per dtype and an index of names and shapes: lossless and in order
both ways, and a layout from an untrusted reply that does not tile its buffers exactly is refused, named,
before any view of it is made."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fleet.federated.shared.packing import pack, unpack


def model_arrays() -> dict:
    rng = np.random.default_rng(0)
    return {
        "conv.weight": rng.normal(size=(4, 1, 3, 3)).astype(np.float16),
        "bn.num_batches_tracked": np.array(5, np.int64),
        "fc.weight": torch.randn(3, 4).to(torch.float16),
        "fc.bias": np.zeros(3, np.float16),
        "empty": np.zeros((0, 2), np.float32),
    }


def test_packing_is_lossless_in_order_and_one_buffer_per_dtype():
    arrays = model_arrays()
    packed = pack(arrays)
    assert {d: b.size for d, b in packed.buffers.items()} == {"float16": 36 + 12 + 3, "int64": 1, "float32": 0}
    got = unpack(packed.buffers, packed.index)
    assert list(got) == list(arrays)
    for name, a in arrays.items():
        want = a.numpy() if isinstance(a, torch.Tensor) else a
        assert got[name].shape == want.shape and got[name].dtype == want.dtype
        np.testing.assert_array_equal(got[name], want)
        assert got[name].size == 0 or np.shares_memory(got[name], packed.buffers[want.dtype.name])  # views


def layout(**changes) -> tuple[dict, dict]:
    packed = pack({"a": np.ones((2, 3), np.float16), "b": np.ones(4, np.float16)})
    return dict(packed.buffers), {**packed.index, **changes}


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"names": ["a", "a"]}, "a name comes twice"),
        ({"names": ["a"]}, "differ in length"),
        ({"shapes": [2, -3, 4]}, "do not match its ndims"),
        ({"shapes": [-2, -3, 4]}, "do not match its ndims"),  # two negatives whose product is positive
        ({"ndims": [33, 1]}, "do not match its ndims"),
        ({"shapes": [2, 3]}, "do not match its ndims"),
        ({"shapes": [2, 4, 4]}, "'b': its buffer 'float16' ends before it does"),
        ({"shapes": [2, 3, 3]}, "a buffer holds more than the index lays out"),  # a hidden tail
        ({"shapes": [2**40, 2**40, 4]}, "'a': its buffer 'float16' ends before it does"),
        ({"dtypes": ["float16", "float32"]}, "'b': no buffer of 'float32'"),
        ({"names": "ab"}, "'names' is not a list of str"),
        ({"ndims": [2.0, 1]}, "'ndims' is not a list of int"),
        ({"ndims": [True, 1]}, "'ndims' is not a list of int"),
        ({"shapes": None}, "'shapes' is not a list of int"),
    ],
)
def test_a_layout_that_does_not_tile_its_buffers_is_refused_with_its_reason(changes, reason):
    buffers, index = layout(**changes)
    with pytest.raises(ValueError, match=reason):
        unpack(buffers, index)


def test_a_buffer_under_another_dtype_or_shape_or_never_named_is_refused():
    buffers, index = layout()
    with pytest.raises(ValueError, match="buffer 'float16' is not a flat array of float16"):
        unpack({"float16": buffers["float16"].astype(np.float32)}, index)
    with pytest.raises(ValueError, match="is not a flat array"):
        unpack({"float16": buffers["float16"].reshape(2, 5)}, index)
    with pytest.raises(ValueError, match="a buffer holds more than the index lays out"):
        unpack({**buffers, "int8": np.zeros(3, np.int8)}, index)
