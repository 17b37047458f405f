"""Profile records for memory planning: what each block saves and costs, and what
paging costs on this device's storage.

:func:`fleet.memory.measure.measure_block_costs` fills a :class:`MemoryProfile`
and :func:`fleet.memory.storage.measure_storage` a :class:`StorageProfile`; the
planner reads nothing else. Both are plain dataclasses with
``to_dict``/``from_dict`` for YAML or JSON; ``from_dict`` refuses unknown
fields and other format versions, so a stale profile is re-measured instead
of being misread.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from fleet.base.errors import ProfileMismatchError
from fleet.memory.spill import DEFAULT_MIN_BYTES

FORMAT_VERSION = 1


@dataclass
class BlockCost:
    """One block of the chain."""

    name: str  # qualified module name
    kind: str  # module class
    forward_s: float  # forward time in a training step
    backward_s: float
    params: int
    recompute_s: float = 0.0  # measured extra backward time when checkpointed (>= forward_s)
    can_recompute: bool = True
    note: str = ""  # why it cannot be recomputed


@dataclass
class SavedItem:
    """One storage held for backward (bytes counted once however many tensors view it)."""

    bytes: int
    savers: list[int]  # blocks that save it for backward
    inputs_of: list[int] = field(default_factory=list)  # blocks whose input it is
    # Last block whose forward runs while the caller still references it (e.g. the input of an
    # nn.Sequential stays referenced until the whole Sequential returns); -1: its own blocks only.
    alive_until: int = -1


@dataclass
class StorageProfile:
    """Spill-file costs on this device: ``latency + bytes / throughput`` per direction."""

    spill_dir: str
    sync: bool
    write_latency_s: float
    write_bytes_per_s: float
    read_latency_s: float
    read_bytes_per_s: float
    storage_watts: float | None = None  # power drawn while paging, for the energy objective
    samples: list[dict] = field(default_factory=list)  # bytes, write_s, read_s (medians)
    source: str = "probe"  # "probe": measure_storage's files; "in-step": the pager during real steps

    def write_time(self, nbytes: float) -> float:
        return self.write_latency_s + nbytes / self.write_bytes_per_s

    def read_time(self, nbytes: float) -> float:
        return self.read_latency_s + nbytes / self.read_bytes_per_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StorageProfile:
        return _from_dict(cls, d, "storage profile")


@dataclass
class MemoryProfile:
    """Per-block activation memory and recompute time of one model at one input shape."""

    model: str
    input_shape: list[int]
    blocks: list[BlockCost]
    items: list[SavedItem]
    pinned_bytes: int  # held throughout whatever the plan
    measured_peak_bytes: int  # activation peak of an unplanned step (StorageMeter)
    step_s: float  # median unplanned step (forward + loss + backward)
    page_min_bytes: int = DEFAULT_MIN_BYTES  # smaller storages stay in memory when a block is paged
    dtype: str = "float32"
    threads: int = 1
    torch_version: str = ""
    host: str = ""
    compute_watts: float | None = None  # power drawn while computing, for the energy objective
    storage: StorageProfile | None = None
    format_version: int = FORMAT_VERSION

    @property
    def batch_size(self) -> int:
        return int(self.input_shape[0])

    @property
    def model_peak_bytes(self) -> int:
        """Unplanned peak by the planner's memory model: everything held at once."""
        return self.pinned_bytes + sum(i.bytes for i in self.items if i.savers)

    @property
    def unconstrained_peak_bytes(self) -> int:
        """The peak that budget fractions refer to (measured when available)."""
        return self.measured_peak_bytes or self.model_peak_bytes

    def describe(self) -> str:
        return f"{self.model} at batch {self.batch_size}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["storage"] = self.storage.to_dict() if self.storage is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MemoryProfile:
        d = dict(d)
        version = d.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ProfileMismatchError(
                f"memory profile format_version is {version}, this fleet reads {FORMAT_VERSION}; re-measure the profile"
            )
        d["blocks"] = [_from_dict(BlockCost, b, "memory profile block") for b in d.get("blocks", [])]
        d["items"] = [_from_dict(SavedItem, i, "memory profile item") for i in d.get("items", [])]
        if d.get("storage") is not None:
            d["storage"] = StorageProfile.from_dict(d["storage"])
        return _from_dict(cls, d, "memory profile")


def _from_dict(cls, d: dict, what: str):
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ProfileMismatchError(
            f"{what}: unknown field {unknown[0]!r}; re-measure the profile with this fleet version"
        )
    try:
        return cls(**d)
    except TypeError as exc:
        raise ProfileMismatchError(f"{what}: {exc}; re-measure the profile with this fleet version") from None
