"""A tensor read in place from the ``.npy`` bytes a Flower ``Array`` carries.

``Array.numpy()`` hands its bytes to ``np.load``, which copies them in chunks: on a ResNet-18
that is 45 MB a message, copied once on the server for every reply it only reads, and on a
device copied twice where one copy is all the model needs. :func:`npy_view` reads the header
with NumPy's own parser, checks the length, and returns a read-only view of the bytes; the apps
check the ``Array``'s serialization type (Flower's) before they hand its bytes here.
"""

from __future__ import annotations

import io
import math

import numpy as np
from numpy.lib import format as npy

HEADERS = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}  # what np.save writes


def npy_view(data: bytes) -> np.ndarray:
    """The array ``data`` (a plain numeric ``.npy``) holds, as a read-only view of it. Anything else raises
    (TypeError, ValueError), as ``np.load(..., allow_pickle=False)`` would: another version, an object
    array, a truncated payload."""
    head = io.BytesIO(data)
    read_header = HEADERS.get(npy.read_magic(head))
    if read_header is None:
        raise TypeError("not a .npy of version 1 or 2")
    shape, fortran_order, dtype = read_header(head)
    if dtype.hasobject:
        raise TypeError("object arrays are not tensors")
    values = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=head.tell())
    return values.reshape(shape, order="F" if fortran_order else "C")
