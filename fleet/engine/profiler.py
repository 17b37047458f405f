"""Tensor timing profiler: what each trainable tensor costs on *this* device.

The model is read as the chain of its parametric layers in forward execution
order (docs/algorithms.md section 1). Times are measured in context, inside real
backward passes of the whole model, rather than layer by layer in isolation,
so that caches, threading and the non-parametric ops between layers (ReLU,
pooling, residual adds) are paid as they really are:

* Backward run A (every parameter and the input require grad) and run B (only
  the input requires grad) each stamp the moment the error gradient reaches
  every layer's output. In backward execution order, the gap between one
  layer's stamp and the next is that layer's backward work plus the
  non-parametric ops below it, which is exactly how the timing model charges
  them. Run B's gap is the layer's ``t_dy``; run A's gap minus run B's is its
  weight-gradient time, split among the layer's tensors by isolated
  micro-measurements.
* The optimizer update is timed per tensor with the trainer's own optimizer.
* ``t_fw`` is the fixed part of any training step: forward, loss, the loss's
  own backward and the optimizer call overhead.
* Real full training steps, timed as the trainer runs them, calibrate the sums
  of the forward pieces and of the backward pieces (two factors, recorded in
  the profile).

Runs are interleaved and repeated; every figure is a median.

Every moment is stamped by the device's clock (fleet/engine/accelerator.py): the host's on the
CPU; on a CUDA GPU, events recorded on the stream and read after it synchronizes, so a stamp
marks when the queued work finished rather than when it was queued. Under mixed precision every
pass runs under the autocast it trains with, so the profile is in the precision training pays.
"""

from __future__ import annotations

import contextlib
import copy
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fleet.base.hooks import first_tensor, no_grad_forward
from fleet.engine.accelerator import (
    CUDA_WARMUP,
    Clock,
    HostClock,
    Precision,
    clock_for,
    elapsed,
    on_device,
)
from fleet.engine.device_profile import DeviceProfile, TensorTiming
from fleet.engine.models import input_channels

LayerOrder = list[tuple[str, nn.Module]]


def parametric_layers(model: nn.Module, example: torch.Tensor) -> LayerOrder:
    """Modules that own trainable parameters directly, in forward execution order."""
    owners = {id(m): (n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    order: LayerOrder = []
    seen: set[int] = set()

    def hook(module: nn.Module, _inputs, _output) -> None:
        if id(module) in owners and id(module) not in seen:
            seen.add(id(module))
            order.append(owners[id(module)])

    was_training = model.training
    model.eval()
    no_grad_forward(model, example[:1], post_hooks=[(m, hook) for _, m in owners.values()])
    model.train(was_training)
    order.extend(owners[i] for i in owners if i not in seen)  # never run in forward: cost 0
    return order


def tensor_order(model: nn.Module, example: torch.Tensor) -> list[tuple[str, str, nn.Parameter]]:
    """(tensor name, layer name, parameter) for every trainable tensor, input side first."""
    return tensors_of(parametric_layers(model, example))


def tensors_of(layers: LayerOrder) -> list[tuple[str, str, nn.Parameter]]:
    """:func:`tensor_order` from the layers :func:`parametric_layers` found: a caller that needs both runs
    the model's forward pass once (a simulated device builds a trainer for every message)."""
    out = []
    for layer_name, layer in layers:
        for pname, p in layer.named_parameters(recurse=False):
            full = f"{layer_name}.{pname}" if layer_name else pname
            out.append((full, layer_name, p))
    return out


def _backward_stamps(
    model: nn.Module,
    layers: LayerOrder,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable,
    clock: Clock,
) -> tuple[dict[int, float], float, float]:
    """One forward+backward; returns {layer index: grad arrival time}, backward start and end."""
    stamps: dict[int, Any] = {}
    handles = []

    def make_hook(index: int):
        def on_forward(_module, _inputs, output):
            out = first_tensor(output)
            if out is not None and out.requires_grad:

                def on_grad(_grad):
                    if index not in stamps:
                        stamps[index] = clock.stamp()

                out.register_hook(on_grad)

        return on_forward

    for i, (_, layer) in enumerate(layers):
        handles.append(layer.register_forward_hook(make_hook(i)))
    try:
        x = x.detach().requires_grad_(True)
        loss = loss_fn(model(x), y)
        start = clock.stamp()
        loss.backward()
        end = clock.stamp()
    finally:
        for h in handles:
            h.remove()
    return {i: clock.seconds(m) for i, m in stamps.items()}, clock.seconds(start), clock.seconds(end)


def _forward_stamps(
    model: nn.Module, layers: LayerOrder, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, clock: Clock
) -> tuple[dict[int, float], float, torch.Tensor]:
    """One forward; returns {layer index: time its forward starts}, the end time and the loss."""
    stamps: dict[int, Any] = {}

    def pre(i: int) -> None:
        if i not in stamps:
            stamps[i] = clock.stamp()

    handles = [layer.register_forward_pre_hook(lambda *_a, i=i: pre(i)) for i, (_, layer) in enumerate(layers)]
    try:
        loss = loss_fn(model(x), y)
        end = clock.stamp()
    finally:
        for h in handles:
            h.remove()
    return {i: clock.seconds(m) for i, m in stamps.items()}, clock.seconds(end), loss


def _gaps(stamps: dict[int, float], end: float) -> dict[int, float]:
    """Time from each layer's grad arrival to the next arrival (or the end of backward)."""
    ordered = sorted(stamps.items(), key=lambda kv: kv[1])
    gaps = {}
    for (index, t), nxt in zip(ordered, ordered[1:] + [(None, end)]):
        gaps[index] = max(nxt[1] - t, 0.0)
    return gaps


def _set_trainable(params: Sequence[nn.Parameter], flag: bool) -> None:
    for p in params:
        p.requires_grad_(flag)
        p.grad = None


def _median_or_zero(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _median_time(fn: Callable[[], object], repeats: int, clock: Clock) -> float:
    times = []
    for _ in range(repeats):
        start = clock.stamp()
        fn()
        times.append(elapsed(clock, start, clock.stamp()))
    return statistics.median(times)


def _split_within_layer(layer: nn.Module, x_in: torch.Tensor, repeats: int, clock: Clock) -> list[float]:
    """Shares of a layer's weight-gradient time among its tensors, from isolated timings."""
    params = list(layer.parameters(recurse=False))
    if len(params) == 1:
        return [1.0]
    x_in = x_in.detach()
    out = first_tensor(layer(x_in))
    grad_out = torch.randn_like(out)
    costs = []
    for p in params:
        grad = lambda p=p: torch.autograd.grad(out, [p], grad_out, retain_graph=True)  # noqa: E731
        costs.append(_median_time(grad, repeats, clock))
    total = sum(costs) or 1.0
    return [c / total for c in costs]


def _layer_inputs(model: nn.Module, layers: LayerOrder, x: torch.Tensor) -> dict[int, torch.Tensor]:
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i, (_, layer) in enumerate(layers):

        def pre(_m, inputs, i=i):
            if i not in captured and inputs and isinstance(inputs[0], torch.Tensor):
                captured[i] = inputs[0].detach()

        hooks.append((layer, pre))
    no_grad_forward(model, x, pre_hooks=hooks)
    return captured


@dataclass
class _Samples:
    """Raw timings of the interleaved runs; the dicts hold one list per layer index."""

    gaps_a: dict[int, list[float]]  # backward gaps, every parameter trainable (run A)
    gaps_b: dict[int, list[float]]  # backward gaps, only the input requires grad (run B)
    fw_rec: dict[int, list[float]]  # forward gaps, everything trainable (graph recorded)
    fw_plain: dict[int, list[float]]  # forward gaps, nothing trainable (no graph)
    fw_times: list[float] = field(default_factory=list)  # whole forwards with nothing trainable
    head_times: list[float] = field(default_factory=list)  # backward start to the first layer's stamp
    step_times: list[tuple[float, float]] = field(default_factory=list)  # (forward, backward + update) of real steps

    @classmethod
    def empty(cls, n_layers: int) -> _Samples:
        def per_layer() -> dict[int, list[float]]:
            return {i: [] for i in range(n_layers)}

        return cls(per_layer(), per_layer(), per_layer(), per_layer())


@dataclass
class _Pieces:
    """Uncalibrated costs, per layer (in forward order) or per tensor (in :func:`tensor_order`)."""

    forward: float  # a whole forward with nothing trainable
    fixed_backward: float  # the loss's own backward plus the optimizer call overhead
    dy: list[float]  # per layer: backward gap with only the input requiring grad
    rec: list[float]  # per layer: graph-recording cost in the forward
    dw: list[list[float]]  # per layer, per tensor: weight-gradient time
    opt: list[float]  # per tensor: optimizer update time


@dataclass
class _Run:
    """What every timed run of one profiling session shares."""

    model: nn.Module
    layers: LayerOrder
    params: list[nn.Parameter]
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable
    clock: Clock = field(default_factory=HostClock)
    precision: Precision | None = None  # the real steps' backward and update (a gradient scaler under amp)

    def trainable(self, flag: bool) -> None:
        _set_trainable(self.params, flag)


def _add_gaps(into: dict[int, list[float]], stamps: dict[int, float], end: float) -> None:
    for i, g in _gaps(stamps, end).items():
        into[i].append(g)


def _warm_up(run: _Run, warmup: int) -> None:
    run.trainable(True)
    for _ in range(warmup):
        run.loss_fn(run.model(run.x), run.y).backward()
        run.trainable(True)


def _time_real_step(run: _Run, optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """(forward, backward + update) of a full training step, timed exactly as the trainer runs it."""
    run.trainable(True)
    clock = run.clock
    start = clock.stamp()
    optimizer.zero_grad(set_to_none=True)
    loss = run.loss_fn(run.model(run.x), run.y)
    middle = clock.stamp()
    if run.precision is None:
        loss.backward()
        optimizer.step()
    else:
        run.precision.backward(loss)
        run.precision.step(optimizer)
    end = clock.stamp()
    return elapsed(clock, start, middle), elapsed(clock, middle, end)


def _sample_forwards(run: _Run, samples: _Samples) -> None:
    """Forward with nothing trainable (no graph recorded) and with everything trainable.

    The difference is each layer's recording cost, paid only above the input-most selected tensor.
    """
    run.trainable(False)
    start = run.clock.seconds(run.clock.stamp())
    stamps, end, _ = _forward_stamps(run.model, run.layers, run.x, run.y, run.loss_fn, run.clock)
    samples.fw_times.append(end - start)
    _add_gaps(samples.fw_plain, stamps, end)
    run.trainable(True)
    stamps, end, loss = _forward_stamps(run.model, run.layers, run.x, run.y, run.loss_fn, run.clock)
    del loss
    _add_gaps(samples.fw_rec, stamps, end)


def _sample_backwards(run: _Run, samples: _Samples) -> None:
    """Backward run A (everything trainable, as left by the forwards), then run B (only the input)."""
    stamps, bstart, end = _backward_stamps(run.model, run.layers, run.x, run.y, run.loss_fn, run.clock)
    if stamps:
        samples.head_times.append(min(stamps.values()) - bstart)
    _add_gaps(samples.gaps_a, stamps, end)
    run.trainable(False)
    stamps, _, end = _backward_stamps(run.model, run.layers, run.x, run.y, run.loss_fn, run.clock)
    _add_gaps(samples.gaps_b, stamps, end)


def _collect_samples(
    run: _Run, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], repeats: int
) -> _Samples:
    """Real steps, forwards and backwards, interleaved and repeated."""
    samples = _Samples.empty(len(run.layers))
    step_optimizer = make_optimizer(run.params)
    for _ in range(repeats):
        # A real full training step is the anchor for calibration.
        samples.step_times.append(_time_real_step(run, step_optimizer))
        _sample_forwards(run, samples)
        _sample_backwards(run, samples)
    run.trainable(True)
    return samples


def _pieces(
    model: nn.Module,
    layers: LayerOrder,
    params: list[nn.Parameter],
    x: torch.Tensor,
    samples: _Samples,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    repeats: int,
    clock: Clock,
) -> _Pieces:
    """Medians of the samples, turned into per-layer and per-tensor costs (run A minus run B is t_dw)."""
    inputs = _layer_inputs(model, layers, x)
    layer_b: list[float] = []
    layer_rec: list[float] = []
    layer_dw: list[list[float]] = []
    for i, (_, layer) in enumerate(layers):
        a, b = _median_or_zero(samples.gaps_a[i]), _median_or_zero(samples.gaps_b[i])
        shares = _split_within_layer(layer, inputs[i], max(3, repeats // 2), clock) if i in inputs else None
        n_params = len(list(layer.parameters(recurse=False)))
        shares = shares or [1.0 / n_params] * n_params
        layer_b.append(b)
        layer_rec.append(max(_median_or_zero(samples.fw_rec[i]) - _median_or_zero(samples.fw_plain[i]), 0.0))
        layer_dw.append([max(a - b, 0.0) * s for s in shares])
    t_opt, t_opt_fixed = _optimizer_times(params, make_optimizer, repeats, clock)
    return _Pieces(
        forward=statistics.median(samples.fw_times),
        fixed_backward=(statistics.median(samples.head_times) if samples.head_times else 0.0) + t_opt_fixed,
        dy=layer_b,
        rec=layer_rec,
        dw=layer_dw,
        opt=t_opt,
    )


def _calibration(pieces: _Pieces, step_times: list[tuple[float, float]]) -> tuple[float, float]:
    """Factors (forward, backward) that make the pieces of a full step add up to a real one.

    Isolated pieces miss part of what a real step pays between them (allocator, thread
    wake-ups, caches refilled after the optimizer pass). Scale the forward pieces and the
    backward/update pieces so that a real full step costs what it measurably costs; partial
    selections are then predicted from the pieces' relative costs.
    """
    real_forward = statistics.median(f for f, _ in step_times)
    real_backward = statistics.median(b for _, b in step_times)
    pieces_forward = pieces.forward + sum(pieces.rec)
    pieces_backward = pieces.fixed_backward + sum(pieces.dy[1:]) + sum(map(sum, pieces.dw)) + sum(pieces.opt)
    cal_f = real_forward / pieces_forward if pieces_forward > 0 else 1.0
    cal_b = real_backward / pieces_backward if pieces_backward > 0 else 1.0
    return cal_f, cal_b


def _tensor_timings(
    layers: LayerOrder,
    order: list[tuple[str, str, nn.Parameter]],
    layer_dw: list[list[float]],
    t_opt: list[float],
    layer_dy: list[float],
) -> list[TensorTiming]:
    """One TensorTiming per tensor; a layer's ``t_dy`` is charged to its first tensor."""
    timings: list[TensorTiming] = []
    k = 0
    for i, (layer_name, layer) in enumerate(layers):
        for j, (_pname, p) in enumerate(layer.named_parameters(recurse=False)):
            name, _, _ = order[k]
            timings.append(
                TensorTiming(
                    name=name,
                    layer=layer_name,
                    shape=list(p.shape),
                    t_dw=layer_dw[i][j],
                    t_opt=t_opt[k],
                    t_dy=layer_dy[i] if j == 0 else 0.0,
                )
            )
            k += 1
    return timings


def measure_tensor_timings(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    loss_fn: Callable = nn.functional.cross_entropy,
    repeats: int = 7,
    warmup: int = 2,
    precision: Precision | None = None,
) -> tuple[float, list[TensorTiming], dict[str, float]]:
    """Measure ``t_fw``, per-tensor timings and the calibration factor on a private copy of ``model``.

    ``x``/``y`` is one training batch of the size the profile is for, on the device to measure
    (the copy of the model is moved there). ``precision``: mixed precision, under which every pass
    runs (None: float32).
    """
    model = copy.deepcopy(model).train()
    if x.device.type != "cpu":
        model.to(x.device)
        warmup = max(warmup, CUDA_WARMUP)
    layers = parametric_layers(model, x)
    order = tensors_of(layers)
    params = [p for _, _, p in order]

    amp = precision is not None and precision.amp
    run = _Run(model, layers, params, x, y, loss_fn, clock_for(x.device), precision if amp else None)
    with precision.autocast() if amp else contextlib.nullcontext():
        _warm_up(run, warmup)
        samples = _collect_samples(run, make_optimizer, repeats)
        pieces = _pieces(model, layers, params, x, samples, make_optimizer, repeats, run.clock)
    cal_f, cal_b = _calibration(pieces, samples.step_times)

    t_fw = pieces.forward * cal_f + pieces.fixed_backward * cal_b
    layer_dy = [b * cal_b + r * cal_f for b, r in zip(pieces.dy, pieces.rec)]
    layer_dw = [[v * cal_b for v in row] for row in pieces.dw]
    t_opt = [v * cal_b for v in pieces.opt]
    timings = _tensor_timings(layers, order, layer_dw, t_opt, layer_dy)
    return t_fw, timings, {"forward": cal_f, "backward": cal_b}


def _optimizer_times(
    params: list[nn.Parameter],
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    repeats: int,
    clock: Clock,
) -> tuple[list[float], float]:
    """Per-tensor update time and the fixed cost of an optimizer call with nothing to do."""
    originals = [p.detach().clone() for p in params]
    optimizer = make_optimizer(params)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # creates state (momentum buffers) like a real run
    for p in params:
        p.grad = None
    fixed = _median_time(optimizer.step, repeats, clock)
    per_tensor = []
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
        t = _median_time(optimizer.step, repeats, clock)
        p.grad = None
        per_tensor.append(max(t - fixed, 0.0))
    with torch.no_grad():
        for p, o in zip(params, originals):
            p.copy_(o)
    return per_tensor, fixed


def cpu_model() -> str:
    """The CPU's model name where the OS tells it (Linux), else the platform's processor string: a profile
    says which machine it was measured on, so a reader can tell a reference profile from their own."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_info(device: torch.device | None = None) -> dict[str, str | int]:
    """The machine a profile was measured on; on a CUDA device also its GPU (by name)."""
    info: dict[str, str | int] = {
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 1,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "threads": torch.get_num_threads(),
    }
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = str(torch.version.cuda)
    return info


def profile_device(
    model: nn.Module,
    model_meta: dict,
    *,
    batch_size: int,
    input_size: int,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    repeats: int = 7,
    seed: int = 0,
    device: torch.device | None = None,
    amp: bool = False,
) -> DeviceProfile:
    """Measure ``model`` on this device (``device``: the CPU when None) for a batch of random inputs of the
    given size, in mixed precision with ``amp`` (CUDA only). The batch is drawn on the CPU, so it is the
    same on either device."""
    device = device or torch.device("cpu")
    precision = Precision(device, amp)
    in_channels = input_channels(model)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, in_channels, input_size, input_size, generator=gen)
    y = torch.randint(0, int(model_meta.get("num_classes", 2)), (batch_size,), generator=gen)
    x, y = on_device(x, device), on_device(y, device)
    started = time.perf_counter()
    t_fw, tensors, calibration = measure_tensor_timings(
        model, x, y, make_optimizer=make_optimizer, repeats=repeats, precision=precision
    )
    info = host_info(device)
    return DeviceProfile(
        model=dict(model_meta),
        batch_size=batch_size,
        input_size=input_size,
        t_fw=t_fw,
        tensors=tensors,
        dtype=precision.dtype,
        device=device.type,
        threads=int(info["threads"]),
        host=info,
        repeats=repeats,
        calibration=calibration,
        profiling_time_s=time.perf_counter() - started,
    )
