"""Where training runs (train.device, node config device), how it is timed and in which precision: the
device-agnostic parts, tested on the CPU (the default suite needs no GPU; scripts/gpu-check.sh runs the rest)."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import torch

from fleet.base.errors import ConfigError, ProfileMismatchError
from fleet.cli import main
from fleet.engine import accelerator
from fleet.engine.accelerator import HostClock, Precision, clock_for, elapsed, host_copy, resolve_device
from fleet.engine.config import TrainConfig, config_from_dict
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.trainer import Trainer
from fleet.federated.on_device.device import train_device_of
from fleet.federated.on_device.tasks import Device
from fleet.federated.shared import keys, schema
from fleet.federated.shared.config import load_fleet_config
from tests.conftest import BATCH, INPUT, proportional_profile, small_model

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "simulations" / "fleet-tiny.yaml"


def one_line(exc: pytest.ExceptionInfo, start: str) -> str:
    message = str(exc.value)
    assert "\n" not in message and message.startswith(start), message
    return message


# --- train.device --------------------------------------------------------------------------------
def test_auto_is_the_cpu_without_cuda_and_cuda_with_it():
    assert resolve_device("auto", cuda=False) == torch.device("cpu")
    assert resolve_device("auto", cuda=True) == torch.device("cuda")
    assert resolve_device("cpu", cuda=True) == torch.device("cpu")
    assert resolve_device("cuda", cuda=True) == torch.device("cuda")


def test_cuda_without_cuda_is_one_line_naming_the_field():
    with pytest.raises(ConfigError) as exc:
        resolve_device("cuda", cuda=False)
    assert "use auto or cpu" in one_line(exc, "train.device: cuda")
    with pytest.raises(ConfigError) as exc:
        resolve_device("cuda", "node config device", cuda=False)
    one_line(exc, "node config device: cuda")
    with pytest.raises(ConfigError) as exc:
        resolve_device("tpu")
    one_line(exc, "train.device: 'tpu' is not allowed")


def test_config_fields_and_rules():
    cfg = config_from_dict({})
    assert cfg.train.device == "auto" and cfg.train.amp is False
    assert config_from_dict({"train": {"device": "cuda", "amp": True}}).train.amp  # checked where it runs
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"train": {"device": "gpu"}})
    assert "auto, cpu, cuda" in one_line(exc, "train.device: 'gpu' is not allowed")
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"train": {"device": "cpu", "amp": True}})
    one_line(exc, "train.amp: true needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_trainer_without_cuda_is_refused():
    with pytest.raises(ConfigError) as exc:
        Trainer(small_model(), TrainConfig(method="full", device="cuda"), input_size=INPUT)
    one_line(exc, "train.device: cuda")


def test_a_cpu_trainer_keeps_the_host_clock_and_float32():
    trainer = Trainer(small_model(), TrainConfig(method="full", device="cpu"), input_size=INPUT)
    assert trainer.device == torch.device("cpu")
    assert isinstance(trainer.clock, HostClock)
    assert trainer.precision.scaler is None and trainer.precision.dtype == "float32"


# --- timing and precision ------------------------------------------------------------------------
def test_the_clock_follows_the_device(monkeypatch):
    assert isinstance(clock_for(torch.device("cpu")), HostClock)

    class FakeCudaClock:
        def __init__(self, device):
            self.device = device

    monkeypatch.setattr(accelerator, "CudaClock", FakeCudaClock)
    clock = clock_for(torch.device("cuda"))
    assert isinstance(clock, FakeCudaClock) and clock.device.type == "cuda"


def test_host_clock_is_perf_counter_seconds():
    clock = HostClock()
    start = clock.stamp()
    end = clock.stamp()
    assert clock.seconds(start) == start and elapsed(clock, start, end) == end - start >= 0


def test_mixed_precision_needs_cuda_and_float32_is_plain():
    with pytest.raises(ConfigError) as exc:
        Precision(torch.device("cpu"), amp=True)
    one_line(exc, "train.amp: true needs a CUDA device")
    plain = Precision(torch.device("cpu"))
    assert plain.dtype == "float32" and plain.scaler is None
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([w], lr=0.5)
    with plain.autocast():
        loss = (w * 2).sum()
    plain.backward(loss)
    plain.step(optimizer)
    assert torch.equal(w.detach(), torch.zeros(3))  # 1 - 0.5 * 2


def test_host_copy_is_a_clone_on_the_cpu():
    t = torch.arange(4.0, requires_grad=True)
    copy = host_copy(t)
    assert torch.equal(copy, t.detach()) and copy.data_ptr() != t.data_ptr() and not copy.requires_grad


# --- profiles: device and precision --------------------------------------------------------------
def test_profile_records_device_and_dtype_and_loads_old_files(tmp_path):
    profile = proportional_profile(small_model())
    assert (profile.device, profile.dtype) == ("cpu", "float32")
    path = profile.save(tmp_path / "p.yaml")
    assert DeviceProfile.load(path).device == "cpu"
    old = profile.to_dict()
    del old["device"]  # a profile written before it recorded its device: measured on a CPU
    assert DeviceProfile.from_dict(old).device == "cpu"
    gpu = dataclasses.replace(profile, device="cuda", dtype="float16")
    assert DeviceProfile.load(gpu.save(tmp_path / "g.yaml")).device == "cuda"


def test_profile_of_another_device_or_precision_is_refused():
    profile = proportional_profile(small_model())
    profile.check_runs_on("cpu", "float32")
    with pytest.raises(ProfileMismatchError) as exc:
        profile.check_runs_on("cuda", None, "profile p.yaml")
    assert "fleet profile --device cuda" in one_line(exc, "profile p.yaml was measured on cpu, training runs on cuda")
    gpu = dataclasses.replace(profile, device="cuda")
    with pytest.raises(ProfileMismatchError) as exc:
        gpu.check_runs_on("cpu", None, "profile g.yaml")
    one_line(exc, "profile g.yaml was measured on cuda, training runs on cpu")
    half = dataclasses.replace(gpu, dtype="float16")
    with pytest.raises(ProfileMismatchError) as exc:
        half.check_runs_on("cuda", "float32", "profile h.yaml")
    assert "train.amp to true" in one_line(exc, "profile h.yaml was measured in float16")


def test_a_cuda_profile_is_refused_for_a_cpu_run(tmp_path):
    from fleet.engine.experiment import obtain_profile

    model = small_model()
    path = dataclasses.replace(proportional_profile(model), device="cuda").save(tmp_path / "g.yaml")
    cfg = config_from_dict(
        {
            "model": {"in_channels": 1},
            "data": {"input_size": INPUT},
            "train": {"batch_size": BATCH, "device": "cpu"},
            "hardware": {"profile": str(path)},
        }
    )
    with pytest.raises(ProfileMismatchError) as exc:
        obtain_profile(cfg, model)
    one_line(exc, f"profile {path} (hardware.profile) was measured on cuda, training runs on cpu")


# --- a fleet device ------------------------------------------------------------------------------
def test_node_config_device():
    cfg = load_fleet_config(TINY)
    assert train_device_of(cfg, {}) == "auto"
    assert train_device_of(cfg, {keys.NODE_DEVICE: "CPU"}) == "cpu"
    with pytest.raises(ConfigError) as exc:
        train_device_of(cfg, {keys.NODE_DEVICE: "tpu"})
    one_line(exc, "node config device: 'tpu' is not allowed")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError) as exc:
            train_device_of(cfg, {keys.NODE_DEVICE: "cuda"})
        one_line(exc, "node config device: cuda")
    device = Device.from_configs(cfg, {keys.NODE_PARTITION_ID: 0, keys.NODE_DEVICE: "cpu"})
    assert device.cfg.train.device == "cpu" and cfg.train.device == "auto"  # the fleet's config is not changed
    assert Device.from_configs(cfg, {keys.NODE_PARTITION_ID: 0}).cfg is cfg


def test_the_cuda_metric_is_one_or_absent():
    assert keys.CUDA in schema.TRAIN and not schema.TRAIN[keys.CUDA].required
    assert schema.TRAIN[keys.CUDA].problem(1) is None
    assert schema.TRAIN[keys.CUDA].problem(0) is not None and schema.TRAIN[keys.CUDA].problem(2) is not None


def test_simulation_gpu_share_rule():
    assert load_fleet_config(TINY, {"simulation.client_gpus": 0.25}).simulation.client_gpus == 0.25
    with pytest.raises(ConfigError) as exc:
        load_fleet_config(TINY, {"simulation.client_gpus": 1.5})
    one_line(exc, "simulation.client_gpus: 1.5 is not allowed")


# --- the command line ----------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_device_cuda_without_cuda_is_one_line(capsys, tmp_path):
    argv = ["profile", "--model", "resnet18", "--device", "cuda", "--out", str(tmp_path / "p.yaml")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --device: cuda"), err
    assert not (tmp_path / "p.yaml").exists()
    assert main(["bench", "speedup", "--model", "resnet18", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --device: cuda"), err


def test_bench_refuses_a_profile_of_another_device(capsys, tmp_path):
    path = dataclasses.replace(proportional_profile(small_model()), device="cuda").save(tmp_path / "g.yaml")
    assert main(["bench", "timing", "--profile", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was measured on cuda, training runs on cpu" in err[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_check_fails_in_one_line_without_cuda():
    done = subprocess.run(["bash", "scripts/gpu-check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("gpu-check: no CUDA GPU here"), done.stderr
