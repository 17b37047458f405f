"""Cost profiles for memory planning: what each block saves, what recomputing
it takes, and what paging costs on this device's storage.

``measure_block_costs`` runs real training steps (forward, cross-entropy,
backward) of the model at one input shape and records, per block of the
chain (:mod:`fleet.memory.segment`):

* every storage autograd saves for backward, with the blocks that save it
  (``savers``) and the blocks whose input it is (``inputs_of``; a recomputed
  block's checkpoint keeps its input). Parameters, buffers and the model
  input are not activations and are left out, and so are tensors the loss
  saves that did not come out of the graph (its targets). Storages saved outside every
  block (the loss, functional glue such as ``flatten``) or shared by blocks
  that are not neighbours are ``pinned``: always held.
* how long each block's input stays referenced by the calling code during
  the forward pass (a paged input cannot be freed before that);
* forward and backward time, and what recomputing the block really costs:
  the extra backward time of the block when it is checkpointed (steps with
  every block checkpointed alternate with plain ones), never less than its
  forward time; medians over repeats;
* whether it may be recomputed (a block that modifies its input in place,
  such as ``ReLU(inplace=True)``, may not: its checkpointed input would be
  stale);
* the activation peak of an unplanned step, measured by
  :class:`~fleet.memory.meter.StorageMeter`;
* with a storage profile, steps that page every block alternate with the
  plain ones, and the pager's own writes, reads (into fresh buffers) and
  deletions during them are fitted to ``latency + bytes / throughput``
  (deleting a file is charged to writing it): the
  profile's storage costs are those in-step figures (``source="in-step"``),
  which include what a probe of a quiet file misses.

``measure_storage`` times writing and reading spill files of a few sizes and
fits ``time = latency + bytes / throughput`` for each direction.

Both profiles are plain dataclasses with ``to_dict``/``from_dict`` for YAML.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleet.errors import ConfigError, ModelError, ProfileMismatchError
from fleet.hooks import no_grad_forward
from fleet.memory.meter import module_storage_keys, storage_key
from fleet.memory.segment import segment_model
from fleet.memory.spill import DEFAULT_MIN_BYTES, read_file, write_file

FORMAT_VERSION = 1


# --- profile records ------------------------------------------------------------
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
    def from_dict(cls, d: dict) -> "StorageProfile":
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
    def from_dict(cls, d: dict) -> "MemoryProfile":
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
        raise ProfileMismatchError(f"{what}: unknown field {unknown[0]!r}; re-measure the profile with this fleet version")
    try:
        return cls(**d)
    except TypeError as exc:
        raise ProfileMismatchError(f"{what}: {exc}; re-measure the profile with this fleet version") from None


# --- measuring the model ----------------------------------------------------------
class _ModelState:
    """Training mode, requires_grad flags, buffers and grads, restored after profiling."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.training = model.training
        self.flags = [(p, p.requires_grad, p.grad) for p in model.parameters()]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]

    def restore(self) -> None:
        self.model.train(self.training)
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        for p, flag, grad in self.flags:
            p.requires_grad_(flag)
            p.grad = grad


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        for o in obj:
            t = _first_tensor(o)
            if t is not None:
                return t
    if isinstance(obj, dict):
        return _first_tensor(list(obj.values()))
    return None


def _caller_data(t: torch.Tensor) -> bool:
    """Saved outside the model's forward and not computed in the graph: the loss's
    targets, say, which belong to the caller (often a view into the whole dataset)."""
    return t.grad_fn is None and not t.requires_grad


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


def _chain_error(model_name: str, detail: str) -> ModelError:
    return ModelError(
        f"model {model_name}: {detail}; memory planning needs a chain of blocks that each run once "
        "(resnet*, mobilenet*, efficientnet*, vgg*)"
    )


def _record(model: nn.Module, names: list[str], x: torch.Tensor, y: torch.Tensor, model_name: str):
    """One step with hooks: the chain's call order and who saves which storage."""
    modules = [model.get_submodule(n) if n else model for n in names]
    excluded = module_storage_keys(model)
    current: list[int | None] = [None]
    calls: list[int] = []
    in_key: dict[int, int] = {}
    in_bytes: dict[int, int] = {}
    inplace: set[int] = set()
    versions: dict[int, int] = {}
    savers: dict[int, set] = {}
    sizes: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # hold everything seen so no address is reused during the step

    outside = [True]  # not inside the model's forward (the loss, say)

    def root_pre(_m, args):
        outside[0] = False
        for a in args if isinstance(args, tuple) else (args,):
            if isinstance(a, torch.Tensor):
                excluded.add(storage_key(a))

    def root_post(_m, _args, _out):
        outside[0] = True

    def make_pre(i: int):
        def pre(_m, args):
            if current[0] is not None:
                raise _chain_error(model_name, f"block {names[i]!r} runs inside block {names[current[0]]!r}")
            current[0] = i
            calls.append(i)
            t = _first_tensor(args)
            if t is not None:
                keep.append(t)
                in_key[i] = storage_key(t)
                in_bytes[i] = t.untyped_storage().nbytes()
                versions[i] = t._version

        return pre

    def make_post(i: int):
        def post(_m, args, out):
            t = _first_tensor(args)
            if t is not None and t._version != versions.get(i):
                inplace.add(i)
            keep.append(out)
            current[0] = None

        return post

    def pack(t: torch.Tensor):
        key = storage_key(t)
        if key in excluded or t.untyped_storage().nbytes() == 0 or (outside[0] and _caller_data(t)):
            return t
        keep.append(t)
        savers.setdefault(key, set()).add(current[0])
        sizes[key] = t.untyped_storage().nbytes()
        return t

    handles = [model.register_forward_pre_hook(root_pre), model.register_forward_hook(root_post)]
    for i, m in enumerate(modules):
        handles.append(m.register_forward_pre_hook(make_pre(i)))
        handles.append(m.register_forward_hook(make_post(i)))
    try:
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    finally:
        for h in handles:
            h.remove()

    for i in range(len(names)):
        n = calls.count(i)
        if n > 1:
            raise _chain_error(model_name, f"block {names[i]!r} runs {n} times in one forward pass")
    order = list(dict.fromkeys(calls))  # chain position -> block index
    pos = {b: p for p, b in enumerate(order)}
    input_until = _input_lifetimes(model, [modules[b] for b in order], x)

    items: list[SavedItem] = []
    pinned = 0
    input_keys: dict[int, set[int]] = {}
    for b, key in in_key.items():
        if b in pos and key not in excluded:
            input_keys.setdefault(key, set()).add(pos[b])
    for key in list(sizes) + [k for k in input_keys if k not in sizes]:
        who = savers.get(key, set())
        nbytes = sizes.get(key) or max(in_bytes[order[p]] for p in input_keys[key])
        if None in who:  # saved outside every block: glue or loss
            pinned += nbytes
            continue
        sv = sorted(pos[b] for b in who)
        ins = sorted(input_keys.get(key, set()))
        rel = set(sv) | set(ins)
        if max(rel) - min(rel) > 1:
            pinned += nbytes
            continue
        if not sv and not ins:
            continue
        until = max([input_until.get(p, p) for p in ins] + [max(rel)])
        items.append(SavedItem(bytes=int(nbytes), savers=sv, inputs_of=ins, alive_until=until))
    keep.clear()
    return order, items, pinned, {pos[b] for b in inplace if b in pos}


def _input_lifetimes(model: nn.Module, modules: list[nn.Module], x: torch.Tensor) -> dict[int, int]:
    """Chain position -> last chain position during whose forward that block's input is still referenced.

    Measured on a no-grad forward, where only the calling code holds tensors.
    """
    refs: dict[int, Any] = {}
    until: dict[int, int] = {}
    position: list[int] = [0]

    def make_pre(i):
        def pre(_m, args):
            t = _first_tensor(args)
            if t is not None:
                refs[position[0]] = weakref.ref(t.untyped_storage())

        return pre

    def post(_m, _args, _out):
        for p, ref in refs.items():
            if ref() is not None:
                until[p] = position[0]
        position[0] += 1

    no_grad_forward(
        model,
        x,
        pre_hooks=[(m, make_pre(i)) for i, m in enumerate(modules)],
        post_hooks=[(m, post) for m in modules],
    )
    return until


def _time_blocks(model, names, order, x, y, repeats, recompute_runner=None, page_runner=None):
    """Median forward and backward time per block and of the whole step.

    With ``recompute_runner`` (every recomputable block checkpointed), steps
    alternate plain / recomputed and the third result is each block's extra
    backward time when recomputed: what recomputing it really costs
    (checkpoint bookkeeping and fresh allocations included). With
    ``page_runner`` (every block paged) steps alternate with those too."""
    modules = [model.get_submodule(names[b]) if names[b] else model for b in order]
    n = len(modules)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    extra: list[list[float]] = [[] for _ in range(n)]
    steps: list[float] = []
    start: dict[int, float] = {}
    stamps: dict[int, float] = {}
    recording = [True]

    def make_pre(i):
        def pre(_m, _args):
            start[i] = time.perf_counter()

        return pre

    def make_post(i):
        def post(_m, _args, out):
            if recording[0]:
                fwd[i].append(time.perf_counter() - start[i])
            t = _first_tensor(out)
            if t is not None and t.requires_grad:
                t.register_hook(lambda _g: stamps.__setitem__(i, time.perf_counter()))

        return post

    def backward_times(end: float) -> list[float | None]:
        out: list[float | None] = []
        for i in range(n):
            if i not in stamps:
                out.append(None)
                continue
            below = next((stamps[j] for j in range(i - 1, -1, -1) if j in stamps), end)
            out.append(max(below - stamps[i], 0.0))
        return out

    handles = []
    for i, m in enumerate(modules):
        handles.append(m.register_forward_pre_hook(make_pre(i)))
        handles.append(m.register_forward_hook(make_post(i)))
    try:
        for _ in range(repeats):
            stamps.clear()
            recording[0] = True
            t0 = time.perf_counter()
            _step(model, x, y)
            end = time.perf_counter()
            steps.append(end - t0)
            plain = backward_times(end)
            for i, b in enumerate(plain):
                if b is not None:
                    bwd[i].append(b)
            recording[0] = False
            if page_runner is not None:
                with page_runner:
                    _step(model, x, y)
            if recompute_runner is None:
                continue
            stamps.clear()
            with recompute_runner:
                _step(model, x, y)
            for i, (a, b) in enumerate(zip(plain, backward_times(time.perf_counter()))):
                if a is not None and b is not None:
                    extra[i].append(b - a)
    finally:
        for h in handles:
            h.remove()
    med = lambda v: float(statistics.median(v)) if v else 0.0  # noqa: E731
    return [med(v) for v in fwd], [med(v) for v in bwd], [med(v) for v in extra], med(steps)


def _runner_for(model, blocks, actions, shape, spill_dir=None, page_min_bytes=1):
    """An untracked runner for a fixed action list (for timing)."""
    from fleet.memory.executor import apply_plan
    from fleet.memory.planner import MemoryPlan

    plan = MemoryPlan(
        model="",
        input_shape=list(shape),
        blocks=blocks,
        actions=actions,
        overlap=[False] * len(blocks),
        budget_bytes=0,
        objective="time",
        frozen_below=0,
        predicted_peak_bytes=0,
        unconstrained_peak_bytes=0,
        page_min_bytes=page_min_bytes,
    )
    return apply_plan(model, plan, spill_dir, track=False, check_input=False)


def measure_block_costs(
    model: nn.Module,
    input_shape: tuple[int, ...] | list[int],
    *,
    model_name: str | None = None,
    repeats: int = 3,
    warmup: int = 1,
    page_min_bytes: int = DEFAULT_MIN_BYTES,
    compute_watts: float | None = None,
    storage: StorageProfile | None = None,
    seed: int = 0,
) -> MemoryProfile:
    """Profile one training step of ``model`` on inputs of ``input_shape`` (batch first).

    All parameters are trained while measuring (the full-training profile;
    the planner discounts frozen blocks). The model's mode, ``requires_grad``
    flags, buffers and grads are restored afterwards.
    """
    from fleet.memory.executor import apply_plan  # executor imports this module's dataclasses' users

    name = model_name or type(model).__name__
    shape = [int(s) for s in input_shape]
    if len(shape) < 2 or any(s < 1 for s in shape):
        raise ConfigError(f"input_shape: got {shape}; pass (batch, channels, height, width) with positive sizes")
    if repeats < 1:
        raise ConfigError(f"repeats: got {repeats}; use 1 or more")
    names = segment_model(model)
    state = _ModelState(model)
    try:
        model.train()
        for p in model.parameters():
            p.requires_grad_(True)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=gen)
        with torch.no_grad():
            out = model(x)
        if out.dim() != 2:
            raise ModelError(f"model {name}: output shape {tuple(out.shape)} is not (batch, classes); use a classifier")
        y = torch.randint(0, out.shape[1], (shape[0],), generator=gen)
        for _ in range(warmup):
            _step(model, x, y)
        order, items, pinned, inplace = _record(model, names, x, y, name)
        chain = [names[b] for b in order]
        recompute_all = _runner_for(
            model, chain, ["keep" if p in inplace else "recompute" for p in range(len(chain))], shape
        )
        page_all = None
        if storage is not None:
            page_all = _runner_for(model, chain, ["page"] * len(chain), shape, storage.spill_dir, page_min_bytes)
            page_all.io_samples = []
        fwd, bwd, extra, step_s = _time_blocks(
            model, names, order, x, y, repeats, recompute_all, page_all
        )
        meter_runs = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with apply_plan(model, None) as run:
                F.cross_entropy(model(x), y).backward()
            meter_runs.append(run.meter.peak_bytes)
        blocks = []
        for p, b in enumerate(order):
            m = model.get_submodule(names[b]) if names[b] else model
            blk = BlockCost(
                name=names[b],
                kind=type(m).__name__,
                forward_s=fwd[p],
                backward_s=bwd[p],
                params=sum(t.numel() for t in m.parameters()),
            )
            if p in inplace:
                blk.can_recompute = False
                blk.note = "modifies its input in place"
            else:  # never below the forward time: a smaller difference is noise
                blk.recompute_s = max(extra[p], fwd[p])
            blocks.append(blk)
    finally:
        state.restore()
    profile = MemoryProfile(
        model=name,
        input_shape=shape,
        blocks=blocks,
        items=items,
        pinned_bytes=int(pinned),
        measured_peak_bytes=int(max(meter_runs)),
        step_s=step_s,
        page_min_bytes=int(page_min_bytes),
        dtype=str(x.dtype).replace("torch.", ""),
        threads=torch.get_num_threads(),
        torch_version=str(torch.__version__),
        host=platform.node(),
        compute_watts=compute_watts,
        storage=storage,
    )
    if page_all is not None and page_all.io_samples:
        profile.storage = in_step_storage(storage, page_all.io_samples)
    return profile


def in_step_storage(probe: StorageProfile, samples: list[tuple[str, int, float]]) -> StorageProfile:
    """Storage costs fitted to the pager's own operations during real steps.

    Per direction, the median time of each distinct size is fitted to
    ``latency + bytes / throughput``. Deleting a file (which frees its
    page-cache pages) is charged to writing it: it runs on a background
    thread, but on a device whose cores are all computing it is not free."""
    by: dict[tuple[str, int], list[float]] = {}
    for kind, nbytes, seconds in samples:
        by.setdefault((kind, nbytes), []).append(seconds)
    med = {k: statistics.median(v) for k, v in by.items()}
    for (kind, n), t in list(med.items()):
        if kind == "write":
            med[("write", n)] = t + med.get(("unlink", n), 0.0)

    def fit(kind: str, fallback: tuple[float, float]) -> tuple[float, float]:
        pts = [(n, t) for (k, n), t in med.items() if k == kind]
        return _fit(pts) if len({n for n, _ in pts}) >= 2 else fallback

    w_lat, w_thr = fit("write", (probe.write_latency_s, probe.write_bytes_per_s))
    r_lat, r_thr = fit("read", (probe.read_latency_s, probe.read_bytes_per_s))
    sizes = sorted({n for (k, n) in med if k != "unlink"})
    return StorageProfile(
        spill_dir=probe.spill_dir,
        sync=probe.sync,
        write_latency_s=w_lat,
        write_bytes_per_s=w_thr,
        read_latency_s=r_lat,
        read_bytes_per_s=r_thr,
        storage_watts=probe.storage_watts,
        samples=[
            {"bytes": n, "write_s": med.get(("write", n)), "read_s": med.get(("read", n))} for n in sizes
        ],
        source="in-step",
    )


# --- measuring storage ------------------------------------------------------------
DEFAULT_STORAGE_SIZES = (64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = a + n / thr`` with ``a >= 0``; returns (latency, throughput)."""
    n = len(points)
    sx = sum(p[0] for p in points)
    sy = sum(p[1] for p in points)
    sxx = sum(p[0] * p[0] for p in points)
    sxy = sum(p[0] * p[1] for p in points)
    den = n * sxx - sx * sx
    slope = (n * sxy - sx * sy) / den if den > 0 else 0.0
    a = (sy - slope * sx) / n
    if a < 0 or slope <= 0:
        a = max(a, 0.0)
        slope = max(sum(p[0] * (p[1] - a) for p in points) / sxx, 1e-12)
    return a, 1.0 / slope


def measure_storage(
    spill_dir: str | os.PathLike,
    *,
    sizes: tuple[int, ...] = DEFAULT_STORAGE_SIZES,
    repeats: int = 5,
    sync: bool = False,
    storage_watts: float | None = None,
) -> StorageProfile:
    """Time spill-file writes and reads in ``spill_dir`` the way the pager does them."""
    spill_dir = os.fspath(spill_dir)
    try:
        os.makedirs(spill_dir, exist_ok=True)
        work = tempfile.mkdtemp(prefix="fleet-storage-", dir=spill_dir)
    except OSError as exc:
        raise ConfigError(
            f"spill_dir: cannot write to {spill_dir!r} ({exc.strerror}); pass a writable directory with --spill-dir"
        ) from None
    samples = []
    try:
        gen = torch.Generator().manual_seed(0)
        for size in sizes:
            data = torch.randint(0, 256, (int(size),), dtype=torch.uint8, generator=gen)
            writes, reads = [], []
            for r in range(repeats):
                path = os.path.join(work, f"probe{r}.bin")
                t0 = time.perf_counter()
                write_file(path, data, sync=sync)
                t1 = time.perf_counter()
                read_file(path, int(size), sync=sync)
                t2 = time.perf_counter()
                os.unlink(path)
                writes.append(t1 - t0)
                reads.append(t2 - t1)
            samples.append(
                {"bytes": int(size), "write_s": statistics.median(writes), "read_s": statistics.median(reads)}
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    w_lat, w_thr = _fit([(s["bytes"], s["write_s"]) for s in samples])
    r_lat, r_thr = _fit([(s["bytes"], s["read_s"]) for s in samples])
    return StorageProfile(
        spill_dir=spill_dir,
        sync=sync,
        write_latency_s=w_lat,
        write_bytes_per_s=w_thr,
        read_latency_s=r_lat,
        read_bytes_per_s=r_thr,
        storage_watts=storage_watts,
        samples=samples,
    )
