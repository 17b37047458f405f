"""Memory budgets on a CUDA device, as far as the CPU can test them: the pager and meter chosen by the
device, the pinned-host pager's bookkeeping and gradients (with a CPU stand-in for the GPU and pinning
off), pinned-host paging costs in the planner, and which budgets are still refused."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from fleet.base.errors import ConfigError
from fleet.engine.accelerator import check_memory_budget
from fleet.memory.budgeted import _cached
from fleet.memory.executor import apply_plan, pager_kind
from fleet.memory.hostpager import HostPager
from fleet.memory.measure import measure_block_costs
from fleet.memory.meter import CudaMemoryMeter, StorageMeter, allocator_meter
from fleet.memory.planner import KEEP, PAGE, RECOMPUTE, evaluate_plan, plan_memory
from fleet.memory.spill import Kept, Pager
from fleet.memory.storage import fit_host_copies, measure_host_copies, measure_paging

sys.path.insert(0, str(Path(__file__).parent))
from test_memory_executor import BATCH, assert_same, batch, run_step, toy_chain  # noqa: E402

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_pager_follows_the_device():
    assert pager_kind(CPU) == "file"
    assert pager_kind(CUDA) == "host"
    assert pager_kind(CPU, "host") == "host"  # the stand-in the tests below use
    with pytest.raises(ConfigError, match="^pager: 'disk' is not allowed; use one of auto, file, host$"):
        pager_kind(CPU, "disk")


class FakeCudaStats:
    """torch.cuda's memory statistics, scripted."""

    def __init__(self) -> None:
        self.allocated, self.peak, self.resets = 100, 100, 0

    def memory_allocated(self, _device):
        return self.allocated

    def max_memory_allocated(self, _device):
        return self.peak

    def reset_peak_memory_stats(self, _device):
        self.resets += 1
        self.peak = self.allocated


def test_allocator_meter_counts_a_cuda_steps_gpu_memory():
    assert allocator_meter(CPU) is None
    stats = FakeCudaStats()
    meter = allocator_meter(CUDA, stats)
    assert isinstance(meter, CudaMemoryMeter) and stats.resets == 1
    stats.allocated, stats.peak = 150, 400  # the step allocated and freed
    meter.watch_storage(torch.zeros(1000).untyped_storage())  # the allocator counts, not the hooks
    assert (meter.live_bytes, meter.peak_bytes) == (50, 300)
    meter.stop()
    stats.peak = 900  # later work on the GPU does not move a finished step's peak
    assert meter.peak_bytes == 300
    meter.reset_peak()  # a new step counts from what is allocated now
    assert stats.resets == 2 and meter.peak_bytes == 0


def small_profile(model, shape):
    profile = measure_block_costs(model, shape, repeats=1)
    profile.page_min_bytes = 1
    return profile


@pytest.mark.parametrize("mode", ["page", "overlap", "mixed"])
def test_host_pager_gives_the_gradients_of_an_unpaged_step(mode):
    torch.manual_seed(0)
    model = toy_chain()
    shape = (BATCH, 3, 16, 16)
    plan = plan_memory(small_profile(model, shape), 10**12)
    n = len(plan.blocks)
    plan.actions = [[KEEP, RECOMPUTE, PAGE][k % 3] for k in range(n)] if mode == "mixed" else [PAGE] * n
    plan.actions = [KEEP if a == RECOMPUTE and k in (1, 2) else a for k, a in enumerate(plan.actions)]  # in-place
    plan.overlap = [mode != "page"] * n
    plan.page_min_bytes = 1
    x, y = batch(shape)
    reference = copy.deepcopy(model)
    ref_grads, _, _ = run_step(reference, None, x, y, None)
    paged = copy.deepcopy(model)
    grads, peak, left = run_step(paged, plan, x, y, None, pager="host")  # no spill directory needed
    assert left == []
    assert peak is not None and peak > 0
    assert_same(reference, ref_grads, paged, grads)


def test_host_pager_keeps_one_buffer_per_storage_and_frees_it():
    excluded: set[int] = set()
    pager = HostPager(CPU, StorageMeter(), excluded, min_bytes=16, pin=False)
    assert HostPager(CPU, None, set()).pin == torch.cuda.is_available()
    pager.block, pager.overlap = 3, True
    base = torch.arange(64, dtype=torch.float32)
    view = base[8:24].view(4, 4)
    a, b = pager.pack(base), pager.pack(view)
    assert a.record is b.record and pager.bytes_written == 256  # one copy of the storage
    assert isinstance(pager.pack(torch.zeros(2)), Kept)  # below min_bytes
    param = torch.ones(32)
    excluded.add(param.untyped_storage().data_ptr())
    assert isinstance(pager.pack(param), Kept)
    assert torch.equal(pager.unpack(a), base)  # the original is alive: no copy back
    assert pager.bytes_read == 0
    expected = view.clone()
    del base, view  # autograd dropped the activation: the host buffer holds its bytes
    pager.prefetch(3)
    assert pager.bytes_read == 256 and b.record.device_copy is not None
    got = pager.unpack(b)
    assert torch.equal(got, expected) and got.stride() == (4, 1)
    assert b.record.device_copy is None  # no handle left to unpack: only the returned tensor holds it
    record = b.record
    del a, b
    assert record.host is None  # the last handle freed the host buffer
    assert pager.files() == []
    pager.close()
    with pytest.raises(RuntimeError, match="pager is closed"):
        pager.pack(torch.zeros(64))


def test_host_pager_copies_back_on_demand_without_prefetch():
    pager = HostPager(CPU, None, set(), min_bytes=1, pin=False)
    t = torch.randn(10, 3)
    expected = t.clone()
    handle = pager.pack(t)
    del t
    assert torch.equal(pager.unpack(handle), expected) and pager.bytes_read == expected.numel() * 4


def test_file_pager_stays_on_the_cpu(tmp_path):
    torch.manual_seed(0)
    model = toy_chain()
    plan = plan_memory(small_profile(model, (BATCH, 3, 16, 16)), 10**12)
    plan.actions = [PAGE] * len(plan.blocks)
    with apply_plan(model, plan, tmp_path) as run:
        assert isinstance(run.pager, Pager) and isinstance(run.meter, StorageMeter)
    with apply_plan(model, plan, pager="host") as run:
        assert isinstance(run.pager, HostPager) and run.pager.side is None  # a CPU stand-in: no CUDA stream
    with pytest.raises(ConfigError, match="^spill_dir: "):
        apply_plan(model, plan)  # the file pager still needs one


def test_pinned_host_costs_price_paging():
    samples = [
        {"bytes": 1 << 20, "write_s": 1e-5 + (1 << 20) / 20e9, "read_s": 2e-5 + (1 << 20) / 25e9},
        {"bytes": 8 << 20, "write_s": 1e-5 + (8 << 20) / 20e9, "read_s": 2e-5 + (8 << 20) / 25e9},
    ]
    host = fit_host_copies(samples)
    assert host.source == "pinned-host" and host.spill_dir == ""
    assert host.write_latency_s == pytest.approx(1e-5) and host.write_bytes_per_s == pytest.approx(20e9)
    assert host.read_latency_s == pytest.approx(2e-5) and host.read_bytes_per_s == pytest.approx(25e9)
    torch.manual_seed(0)
    profile = small_profile(toy_chain(), (BATCH, 3, 16, 16))
    actions = [PAGE] * len(profile.blocks)
    io = evaluate_plan(profile, actions, storage=host)["io_s"]
    assert 0 < io < 20 * 2e-5 * len(actions) * 4  # latency-bound at these sizes: microseconds, not disk's ms


def test_paging_probe_follows_the_device(tmp_path):
    assert measure_paging(CPU, tmp_path).source == "probe"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="^device: pinned-host paging is measured on a CUDA GPU"):
            measure_host_copies(CUDA)


def test_cached_profile_is_for_its_kind_of_device(tmp_path):
    import json

    torch.manual_seed(0)
    model = toy_chain()
    profile = measure_block_costs(model, (BATCH, 3, 16, 16), model_name="toy", repeats=1)
    profile.storage = fit_host_copies(
        [{"bytes": 1, "write_s": 1e-5, "read_s": 1e-5}, {"bytes": 2, "write_s": 2e-5, "read_s": 2e-5}]
    )
    path = tmp_path / "memory-profile.json"
    path.write_text(json.dumps(profile.to_dict()))
    shape = [BATCH, 3, 16, 16]
    assert _cached(path, "toy", shape, CUDA) is not None
    assert _cached(path, "toy", shape, CPU) is None  # a GPU profile is measured again for the CPU


def test_budget_refusals():
    check_memory_budget(CUDA, 40.0)  # paged to pinned host memory, GPU memory counted
    check_memory_budget(CPU, 40.0)
    check_memory_budget(CUDA, None, amp=True)
    with pytest.raises(ConfigError, match=r"^hardware.memory_budget_mb: a memory budget under train.amp"):
        check_memory_budget(CUDA, 40.0, amp=True)


def test_nothing_in_recompute_pins_to_the_cpu():
    """Recompute runs the block again on whatever device its input is on (checkpoint is device-agnostic)."""
    import inspect

    from fleet.memory import executor

    source = inspect.getsource(executor._Recompute) + inspect.getsource(executor.PlanRunner._recompute_forward)
    assert ".cpu()" not in source and "device=" not in source and "'cpu'" not in source and '"cpu"' not in source
