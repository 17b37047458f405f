"""Where training runs (the CPU or a CUDA GPU), how it is timed there, and in which precision.

Three small pieces, each with a CPU form that does exactly what fleet did before it knew of GPUs:

* :func:`resolve_device` turns ``train.device`` (``auto``, ``cpu``, ``cuda``) into a torch device;
  a ``cuda`` request on a machine without CUDA is one line naming the field, not a traceback later.
* A :class:`Clock` stamps moments. On the CPU a stamp is ``time.perf_counter()``. CUDA kernels are
  queued and run later, so a host clock read after a launch measures the queue, not the work: the
  :class:`CudaClock` records CUDA events on the stream instead and synchronizes before reading them.
* :class:`Precision` is mixed precision (autocast with a gradient scaler) on CUDA when ``train.amp``
  is set, and plain float32 otherwise: no autocast, ``loss.backward()``, ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fleet.base.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
CUDA_WARMUP = 5  # warm-up passes before CUDA timing: the first ones pay cuDNN's algorithm search and allocator growth
AMP_DTYPE = torch.float16  # autocast's type on CUDA: float16 needs the gradient scaler, which fleet uses


def cuda_available() -> bool:
    """Whether torch can train on a CUDA GPU here (one place, so tests can stand in for a GPU machine)."""
    return torch.cuda.is_available()


def resolve_device(requested: str, where: str = "train.device", *, cuda: bool | None = None) -> torch.device:
    """The torch device ``requested`` names: ``auto`` is CUDA where torch sees a GPU, else the CPU.

    ``where`` names the setting in the error (``train.device``, ``node config device``, ``--device``);
    ``cuda`` stands in for :func:`cuda_available` (tests)."""
    if requested not in DEVICES:
        raise ConfigError(f"{where}: {requested!r} is not allowed; use one of {', '.join(DEVICES)}")
    has_cuda = cuda_available() if cuda is None else cuda
    if requested == "cuda" and not has_cuda:
        raise ConfigError(
            f"{where}: cuda, but torch sees no CUDA GPU on this machine (torch.cuda.is_available() is False); "
            "use auto or cpu, or run on a machine with a CUDA GPU and a CUDA build of torch"
        )
    return torch.device("cuda" if requested == "cuda" or (requested == "auto" and has_cuda) else "cpu")


def check_memory_budget(
    device: torch.device, budget: float | None, where: str = "hardware.memory_budget_mb", *, amp: bool = False
) -> None:
    """Refuse what activation memory budgets do not support yet: a budget under mixed precision, whose memory
    profile would be measured in float32 while the steps save float16. On the CPU and on a CUDA GPU (GPU
    memory counted, activations paged to pinned host memory) a float32 budget is allowed."""
    if budget is not None and amp:
        raise ConfigError(
            f"{where}: a memory budget under train.amp is not supported yet (memory profiles are measured in "
            "float32, docs/gpu.md); drop the budget, or set train.amp to false"
        )


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; on the CPU, ``t`` itself (no call into torch, so CPU runs are unchanged)."""
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory: what is sent to the server or saved is a CPU tensor wherever it trained
    (on the CPU, exactly ``t.detach().clone()``)."""
    return t.detach().clone() if t.device.type == "cpu" else t.detach().cpu()


def module_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model without any)."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def device_name(device: torch.device) -> str:
    """What a record says trained: ``cpu``, or ``cuda`` with the GPU's name (``cuda (NVIDIA H100 ...)``)."""
    if device.type != "cuda":
        return device.type
    return f"cuda ({torch.cuda.get_device_name(device)})"


class Clock(Protocol):
    """Stamps moments on a device; :meth:`seconds` turns a stamp into seconds on one time line."""

    def stamp(self) -> Any: ...

    def seconds(self, mark: Any) -> float: ...


class HostClock:
    """The host's clock: a stamp is ``time.perf_counter()`` and is already seconds."""

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, mark: float) -> float:
        return mark


@dataclass
class CudaClock:
    """CUDA events recorded on the current stream; reading one waits for the GPU to reach it, so a
    stamp marks when the queued work before it finished, not when it was queued."""

    device: torch.device
    _origin: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._origin = self.stamp()

    def stamp(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, mark: Any) -> float:
        mark.synchronize()
        return self._origin.elapsed_time(mark) / 1000.0


def clock_for(device: torch.device) -> Clock:
    """The clock that measures work on ``device``: CUDA events on a GPU, the host clock otherwise."""
    return CudaClock(device) if device.type == "cuda" else HostClock()


def elapsed(clock: Clock, start: Any, end: Any) -> float:
    """Seconds from stamp ``start`` to stamp ``end``."""
    return clock.seconds(end) - clock.seconds(start)


@dataclass
class Precision:
    """How a step computes: float32, or on CUDA autocast to float16 with a gradient scaler (``train.amp``).

    A scaler multiplies the loss before backward so small float16 gradients do not flush to zero,
    then unscales them in ``step`` and skips a step whose gradients overflowed."""

    device: torch.device
    amp: bool = False
    scaler: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.amp and self.device.type != "cuda":
            raise ConfigError(
                f"train.amp: true needs a CUDA device, and training runs on {self.device.type}; "
                "set train.amp to false, or train.device to cuda on a machine with a CUDA GPU"
            )
        if self.amp and self.scaler is None:
            self.scaler = torch.amp.GradScaler("cuda")

    @property
    def dtype(self) -> str:
        """The type the forward computes in, as a profile records it."""
        return str(AMP_DTYPE if self.amp else torch.float32).replace("torch.", "")

    def autocast(self) -> contextlib.AbstractContextManager:
        """Around a forward and its loss: autocast under ``amp``, nothing otherwise."""
        return torch.autocast("cuda", dtype=AMP_DTYPE) if self.amp else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, on the scaled loss under ``amp``."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; under ``amp`` the scaler's step (unscale, skip on overflow) and update."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()
