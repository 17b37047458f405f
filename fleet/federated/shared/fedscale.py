"""FedScale's device traces as a device class (``devices.device_classes[].fedscale``): untrusted input.

FedScale publishes two files covering about 100,000 mobile clients (its docs, "Device Trace File
Formats"), both Python pickles of a dict keyed by client id:

* capacity (``client_device_capacity``): ``{"computation": ms per sample, "communication": kbps}``;
* behaviour (``client_behave_trace``): ``{"active": [s, ...], "inactive": [s, ...], "finish_time": s,
  ...}``, the client online from each ``active[i]`` to ``inactive[i]``, repeating every
  ``finish_time`` seconds.

Each simulated device of a FedScale class draws one client that both files describe (seeded), and
takes its uplink (kbps), its availability (the intervals, on the simulated clock) and its speed: the
class's profile stands for the trace's median client, so a device's slow-down factor is its client's
ms per sample over the median's.

Design notes:

* *Pickles run code.* A pickle can name any importable callable and have the loader call it. The
  :class:`~fleet.federated.shared.plain_pickle.DataOnly` unpickler refuses every global, so only the pickle
  opcodes for dicts, lists, tuples, numbers and strings get through; anything else is one line, and
  nothing in the file runs.
* *Pickles claim sizes.* The unpickler allocates what a file declares before reading it, and hashes
  nesting by C recursion; :mod:`fleet.federated.shared.plain_pickle` walks the opcodes first and refuses a
  length past the file's end, nesting past 64 levels and an integer wider than a float.
* *JSON too.* The same two mappings are accepted as ``.json`` files, which need no trust at all; their
  integers are bounded as a pickle's are.
"""

from __future__ import annotations

import json
import pickle
import statistics
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from fleet.base.errors import ConfigError
from fleet.base.numbers import is_real
from fleet.federated.shared.online import Trace
from fleet.federated.shared.paths import resolve_path
from fleet.federated.shared.plain_pickle import json_int, load_plain

FEDSCALE_STREAM = 31  # the seeded draw of a device's client
MAX_TRACE_BYTES = 512 * 2**20  # FedScale's behaviour file is about 60 MB; a larger file is not one of its traces


def read_data_file(path: str, where: str) -> dict:
    """A ``.json`` file, or a pickle read by :func:`~fleet.federated.shared.plain_pickle.load_plain` (its lengths,
    nesting and numbers bounded before anything is built); a mapping at the top, else a one-line error."""
    file = resolve_path(path)
    if not file.is_file():
        raise ConfigError(f"{where}: {path} is not a file; give FedScale's device file (pickle) or the same as .json")
    if file.stat().st_size > MAX_TRACE_BYTES:
        raise ConfigError(f"{where}: {path} is over {MAX_TRACE_BYTES >> 20} MB; give FedScale's device file")
    try:
        raw = file.read_bytes()
        data = json.loads(raw, parse_int=json_int) if file.suffix == ".json" else load_plain(raw)
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{where}: {path} is refused: {exc}; give FedScale's device file as plain data") from None
    except RecursionError:  # JSON's parser recurses per bracket
        raise ConfigError(f"{where}: {path} is nested too deeply to read; give FedScale's device file") from None
    except OSError as exc:
        raise ConfigError(f"{where}: {path} cannot be read ({exc.strerror or exc}); give a readable file") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{where}: {path} holds no mapping of client ids; give FedScale's device file")
    return data


@dataclass(frozen=True)
class Client:
    """One FedScale client: its speed, uplink and online intervals."""

    client_id: str
    ms_per_sample: float
    kbps: float
    period_s: float
    intervals: tuple[tuple[float, float], ...]

    @property
    def trace(self) -> Trace:
        """Its online intervals as the one device of a :class:`~fleet.federated.shared.online.Trace`."""
        return Trace(self.period_s, (self.intervals,))

    def online(self, t: float) -> bool:
        return self.trace.online(0, t)

    def wait_s(self, t: float) -> float:
        """Seconds from ``t`` until the client is next online (0 now; inf never)."""
        return self.trace.wait_s(0, t)


def _positive(value: Any) -> bool:
    return is_real(value) and value > 0


def behaviour_of(entry: Any) -> tuple[float, tuple[tuple[float, float], ...]] | None:
    """(period, intervals) of a behaviour entry, or None when it is not one."""
    if not isinstance(entry, dict):
        return None
    active, inactive, finish = entry.get("active"), entry.get("inactive"), entry.get("finish_time")
    if not (_positive(finish) and isinstance(active, list) and isinstance(inactive, list)):
        return None
    if not all(is_real(v) for v in active + inactive):
        return None
    pairs = tuple((float(a) % finish, float(b) % finish or float(finish)) for a, b in zip(active, inactive))
    return float(finish), tuple((a, b) for a, b in pairs if a < b)


@dataclass(frozen=True)
class ClientTable:
    """The clients both files describe with usable figures, in id order, and their median speed."""

    clients: tuple[Client, ...]
    median_ms: float  # what a device of the class's profile stands for (FedScaleTrace.tier)


def load_clients(capacity: str, behaviour: str) -> ClientTable:
    """The files' :class:`ClientTable`; a one-line error when no client is usable. Read once per process while
    the files are unchanged: every device asks each round, and the median of 100,000 clients is not free."""
    return _clients(capacity, behaviour, _stamp(capacity), _stamp(behaviour))


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = resolve_path(path).stat()
    except OSError:
        return None  # read_data_file names the missing file
    return st.st_mtime_ns, st.st_size


@lru_cache(maxsize=4)
def _clients(capacity: str, behaviour: str, *stamps: tuple[int, int] | None) -> ClientTable:
    where = "devices.device_classes fedscale"  # + _capacity / _behaviour: the class's fields
    caps = {str(k): v for k, v in read_data_file(capacity, f"{where}_capacity").items()}  # ids: ints in a pickle
    behave = {str(k): v for k, v in read_data_file(behaviour, f"{where}_behaviour").items()}
    clients = []
    for cid in sorted(caps.keys() & behave.keys()):
        cap, beh = caps[cid], behaviour_of(behave[cid])
        if not isinstance(cap, dict) or beh is None or not beh[1]:
            continue
        ms, kbps = cap.get("computation"), cap.get("communication")
        if _positive(ms) and _positive(kbps):
            clients.append(Client(cid, float(ms), float(kbps), beh[0], beh[1]))
    if not clients:
        raise ConfigError(
            f"{where}: {capacity} and {behaviour} share no client with a positive computation and communication "
            "and an online interval; give FedScale's client_device_capacity and client_behave_trace"
        )
    return ClientTable(tuple(clients), statistics.median(c.ms_per_sample for c in clients))


@dataclass(frozen=True)
class FedScaleTrace:
    """A class's FedScale files: each device's client, drawn with the seed."""

    capacity: str
    behaviour: str

    def table(self) -> ClientTable:
        return load_clients(self.capacity, self.behaviour)

    def client(self, seed: int, partition_id: int) -> Client:
        clients = self.table().clients
        draw = np.random.default_rng([seed, FEDSCALE_STREAM, partition_id]).integers(len(clients))
        return clients[int(draw)]

    def tier(self, seed: int, partition_id: int) -> float:
        """The device's slow-down on the class's profile, which stands for the trace's median client."""
        return self.client(seed, partition_id).ms_per_sample / self.table().median_ms

    def bandwidth_bytes_per_s(self, seed: int, partition_id: int) -> float:
        return self.client(seed, partition_id).kbps * 1000 / 8
