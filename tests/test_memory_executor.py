"""Executing memory plans on real models: same gradients, peak within budget, clean spill dir."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from fleet.base.errors import ConfigError, ProfileMismatchError
from fleet.bench.memory import bench_model
from fleet.memory.executor import apply_plan, first_trainable_block
from fleet.memory.measure import measure_block_costs
from fleet.memory.planner import FROZEN, KEEP, PAGE, RECOMPUTE, evaluate_plan, plan_memory, resolve_budget
from fleet.memory.records import MemoryProfile
from fleet.memory.segment import segment_model
from fleet.memory.storage import measure_storage

BATCH = 4


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return x + self.act(self.bn(self.conv(x)))


def toy_chain() -> nn.Module:
    """Stem with an in-place ReLU, residual blocks, dropout in the head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        Residual(8),
        nn.MaxPool2d(2),
        Residual(8),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 10)),
    )


def batch(model_in_shape, seed=1):
    """Inputs and targets; the targets are a view into a whole label array, as data loaders give them."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (5000,), generator=g)
    return torch.randn(model_in_shape, generator=g), labels[100 : 100 + model_in_shape[0]]


def run_step(model, plan, x, y, spill_dir, **kw):
    """One step; returns grads, measured peak, files left right after backward."""
    torch.manual_seed(123)  # same dropout masks in every variant
    model.zero_grad(set_to_none=True)
    with apply_plan(model, plan, spill_dir, **kw) as run:
        F.cross_entropy(model(x), y).backward()
        left = run.spill_files()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, run.peak_bytes, left


def assert_same(reference: nn.Module, ref_grads, model: nn.Module, grads):
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:
        assert torch.allclose(ref_grads[name], grads[name], rtol=1e-5, atol=1e-7), name
    for (name, a), b in zip(reference.named_buffers(), model.buffers()):
        assert torch.equal(a, b), f"buffer {name} differs (BatchNorm statistics updated twice?)"


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return measure_storage(tmp_path_factory.mktemp("storage"), repeats=2)


@pytest.fixture(scope="module")
def resnet(storage):
    torch.manual_seed(0)
    model = bench_model("resnet18", 10)
    profile = measure_block_costs(model, (BATCH, 3, 32, 32), model_name="resnet18", repeats=1, storage=storage)
    return model, profile


def test_segments_supported_models():
    import torchvision.models as tvm

    expect = {
        "resnet18": ["conv1", "bn1", "relu", "maxpool", "layer1.0", "layer1.1"],
        "resnet50": ["conv1", "bn1", "relu", "maxpool", "layer1.0", "layer1.1", "layer1.2", "layer2.0"],
        "mobilenet_v2": ["features.0.0", "features.0.1", "features.0.2", "features.1", "features.2"],
        "mobilenet_v3_small": ["features.0.0", "features.0.1", "features.0.2", "features.1", "features.2"],
        "efficientnet_b0": ["features.0.0", "features.0.1", "features.0.2", "features.1.0", "features.2.0"],
        "vgg11_bn": ["features.0", "features.1", "features.2", "features.3", "features.4"],
    }
    for name, head in expect.items():
        with torch.device("meta"):
            model = getattr(tvm, name)(weights=None, num_classes=10)
        blocks = segment_model(model)
        assert blocks[: len(head)] == head, name
        assert blocks[-1] in ("fc", "classifier.1", "classifier.3", "classifier.6"), name
    assert len(segment_model(tvm.resnet50(weights=None))) == 22


def test_profile_matches_measured_unplanned_peak(resnet):
    model, profile = resnet
    assert profile.measured_peak_bytes == profile.model_peak_bytes
    assert [b.name for b in profile.blocks][:4] == ["conv1", "bn1", "relu", "maxpool"]
    assert not profile.blocks[2].can_recompute  # in-place ReLU on its input
    assert all(b.forward_s > 0 for b in profile.blocks)


@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_planned_step_same_gradients_and_within_budget(resnet, tmp_path, fraction):
    model, profile = resnet
    budget = resolve_budget(profile, budget_fraction=fraction)
    plan = plan_memory(profile, budget)
    assert plan.predicted_peak_bytes <= budget
    x, y = batch((BATCH, 3, 32, 32))
    reference = copy.deepcopy(model)
    ref_grads, ref_peak, _ = run_step(reference, None, x, y, tmp_path)
    planned = copy.deepcopy(model)
    grads, peak, left = run_step(planned, plan, x, y, tmp_path)
    assert ref_peak == profile.measured_peak_bytes
    assert peak <= plan.predicted_peak_bytes <= budget
    assert left == []  # files are deleted as backward frees them
    assert os.listdir(tmp_path) == []  # and the step's directory when the context exits
    assert_same(reference, ref_grads, planned, grads)


@pytest.mark.parametrize("mode", [RECOMPUTE, PAGE, "mixed", "sync"])
def test_every_mechanism_gives_the_same_gradients(tmp_path, mode):
    torch.manual_seed(0)
    model = toy_chain()
    shape = (BATCH, 3, 16, 16)
    profile = measure_block_costs(model, shape, repeats=1, storage=measure_storage(tmp_path, repeats=1))
    assert MemoryProfile.from_dict(yaml.safe_load(yaml.safe_dump(profile.to_dict()))) == profile
    profile.page_min_bytes = 1  # page even the small BatchNorm statistics
    plan = plan_memory(profile, 10**12)
    if mode == "mixed":
        plan.actions = [[KEEP, RECOMPUTE, PAGE][k % 3] for k in range(len(plan.blocks))]
    elif mode == "sync":  # fsync + drop from the page cache
        plan.actions = [PAGE] * len(plan.blocks)
    else:
        plan.actions = [mode] * len(plan.blocks)
    plan.actions = [KEEP if a == RECOMPUTE and not b.can_recompute else a for a, b in zip(plan.actions, profile.blocks)]
    plan.overlap = [k % 2 == 0 for k in range(len(plan.blocks))]
    plan.page_min_bytes = 1
    predicted = evaluate_plan(profile, plan.actions, overlap=plan.overlap)["peak_bytes"]
    x, y = batch(shape)
    reference = copy.deepcopy(model)
    ref_grads, _, _ = run_step(reference, None, x, y, tmp_path)
    planned = copy.deepcopy(model)
    grads, peak, left = run_step(planned, plan, x, y, tmp_path, sync=mode == "sync")
    assert left == [] and os.listdir(tmp_path) == []
    assert peak <= predicted
    assert_same(reference, ref_grads, planned, grads)


def test_untracked_runner_reentered_for_several_steps(resnet, tmp_path):
    model, profile = resnet
    assert profile.storage.source == "in-step"  # fitted to the pager's own I/O while profiling
    plan = plan_memory(profile, resolve_budget(profile, budget_fraction=0.3))
    x, y = batch((BATCH, 3, 32, 32))
    reference = copy.deepcopy(model)
    planned = copy.deepcopy(model)
    runner = apply_plan(planned, plan, tmp_path, track=False)
    for _ in range(2):
        ref_grads, _, _ = run_step(reference, None, x, y, tmp_path)
        torch.manual_seed(123)
        planned.zero_grad(set_to_none=True)
        with runner:
            F.cross_entropy(planned(x), y).backward()
        assert runner.peak_bytes is None and os.listdir(tmp_path) == []
        grads = {n: p.grad.clone() for n, p in planned.named_parameters()}
        assert_same(reference, ref_grads, planned, grads)


def test_spill_files_removed_after_error_mid_backward(resnet, tmp_path):
    model, profile = resnet
    model = copy.deepcopy(model)
    plan = plan_memory(profile, 10**12)
    plan.actions = [PAGE] * len(plan.blocks)
    plan.overlap = [True] * len(plan.blocks)
    x, y = batch((BATCH, 3, 32, 32))

    def boom(_grad):
        raise RuntimeError("boom")

    seen = []
    with pytest.raises(RuntimeError, match="boom"):
        with apply_plan(model, plan, tmp_path) as run:
            out = model.layer2(model.layer1(model.maxpool(model.relu(model.bn1(model.conv1(x))))))
            out.register_hook(boom)
            out = model.fc(torch.flatten(model.avgpool(model.layer4(model.layer3(out))), 1))
            seen.append(len(run.spill_files()))
            F.cross_entropy(out, y).backward()
    assert seen[0] > 0  # files existed during the step
    assert os.listdir(tmp_path) == []
    # the model is back to normal
    assert "forward" not in model.layer1[0].__dict__


def test_elastic_selection_frozen_blocks(resnet, tmp_path):
    model, profile = resnet
    model = copy.deepcopy(model)
    names = [b.name for b in profile.blocks]
    fb = names.index("layer3.0")
    for name in names[:fb]:
        for p in model.get_submodule(name).parameters():
            p.requires_grad_(False)
    assert first_trainable_block(model, names) == fb
    budget = resolve_budget(profile, budget_fraction=0.3)
    full = plan_memory(profile, budget)
    plan = plan_memory(profile, budget, frozen_below=fb)
    assert plan.actions[:fb] == [FROZEN] * fb
    assert plan.added_time_s <= full.added_time_s
    x, y = batch((BATCH, 3, 32, 32))
    reference = copy.deepcopy(model)
    ref_grads, ref_peak, _ = run_step(reference, None, x, y, tmp_path)
    assert ref_peak < profile.measured_peak_bytes  # nothing stored below the selection
    grads, peak, _ = run_step(model, plan, x, y, tmp_path)
    assert peak <= plan.predicted_peak_bytes <= budget
    assert_same(reference, ref_grads, model, grads)

    for p in model.layer2.parameters():
        p.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"frozen_below: the plan assumes block 'layer2.0' is frozen"):
        apply_plan(model, plan, tmp_path)


def test_plan_checks_model_and_input(resnet, tmp_path):
    model, profile = resnet
    plan = plan_memory(profile, 10**12)
    with pytest.raises(ProfileMismatchError, match="block 'conv1' is not in this Sequential"):
        apply_plan(toy_chain(), plan, tmp_path)
    x, y = batch((2 * BATCH, 3, 32, 32))
    model = copy.deepcopy(model)
    with pytest.raises(ProfileMismatchError, match="re-plan with --batch-size 8"):
        with apply_plan(model, plan, tmp_path):
            model(x)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["mobilenet_v2", "efficientnet_b0"])
def test_inverted_residual_models(tmp_path, storage, name):
    torch.manual_seed(0)
    model = bench_model(name, 10)
    shape = (2, 3, 32, 32)
    profile = measure_block_costs(model, shape, model_name=name, repeats=1, storage=storage)
    assert profile.measured_peak_bytes == profile.model_peak_bytes
    budget = resolve_budget(profile, budget_fraction=0.3)
    plan = plan_memory(profile, budget)
    x, y = batch(shape)
    reference = copy.deepcopy(model)
    ref_grads, _, _ = run_step(reference, None, x, y, tmp_path)
    grads, peak, left = run_step(model, plan, x, y, tmp_path)
    assert peak <= plan.predicted_peak_bytes <= budget and left == []
    assert_same(reference, ref_grads, model, grads)
