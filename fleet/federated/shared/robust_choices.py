"""The values the ``robust`` section's choice fields may take, in a module that imports nothing.

The ``fleet`` command's parser lists them in its help, and a device's SuperNode and runtime poller are ``fleet``
commands that build that parser: read from the config module, they pulled torch (through the personal tensors'
layer types) into both processes, a pi4's SuperNode held 765 MB resident where it holds about 320 MB without, and
a 1,202 MB pi4 went out of memory at its first message.
"""

AGGREGATIONS = ("mean", "trimmed_mean", "median", "centered_clip")
VALIDATIONS = (None, "start", "trust")  # robust.validate: the server's own data, by loss or by direction
NORM_ACTIONS = ("clip", "reject")
