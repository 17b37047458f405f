"""Elastic training: frozen tensors really get nothing, selections change, state survives."""

import copy
import dataclasses
import json

import pytest
import torch

from fleet.base.errors import BudgetError
from fleet.cli import main
from fleet.data.datasets import batches
from fleet.engine.config import TrainConfig
from fleet.engine.trainer import Trainer
from tests.conftest import BATCH, INPUT, proportional_profile, small_model


def make(method="elastic", profile=None, frozen_norm_stats=False, **kw):
    train = TrainConfig(method=method, batch_size=BATCH, **kw)
    return Trainer(small_model(), train, profile, input_size=INPUT, frozen_norm_stats=frozen_norm_stats)


def first_batch(synthetic):
    return next(batches(synthetic[0], BATCH, shuffle=False, input_size=INPUT))


def test_frozen_tensors_get_no_gradient_and_do_not_move(synthetic, size_profile):
    t = make(profile=size_profile)
    n = len(t.names)
    mask = [False] * n
    kmin = n - 10
    mask[kmin] = mask[n - 1] = mask[n - 4] = True
    t.set_mask(mask)
    before = [p.detach().clone() for p in t.params]
    # Record which layers autograd actually back-propagates through.
    reached = set()
    for name, module in t.model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):

            def on_forward(m, inputs, out, name=name):
                if out.requires_grad:
                    out.register_hook(lambda grad, name=name: reached.add(name))

            module.register_forward_hook(on_forward)
    t.train_step(*first_batch(synthetic))
    for k, (name, p, b) in enumerate(zip(t.names, t.params, before)):
        if mask[k]:
            assert p.grad is not None and not torch.equal(p, b), name
        else:
            assert p.grad is None, name
            assert torch.equal(p, b), name
    kmin_layer = t.names[kmin].rsplit(".", 1)[0]
    input_side_layers = {n.rsplit(".", 1)[0] for n in t.names[:kmin]} - {kmin_layer}
    assert not (reached & input_side_layers), "back-propagation went below the input-most selected tensor"
    assert "fc" in reached and kmin_layer in reached


def test_static_masks_of_baselines():
    tl = make("tl")
    assert [n for n, m in zip(tl.names, tl.mask) if m] == ["fc.weight", "fc.bias"]
    bn = make("bn_bias")
    chosen = [n for n, m in zip(bn.names, bn.mask) if m]
    assert "fc.weight" in chosen and "bn1.weight" in chosen and "bn1.bias" in chosen
    assert not any(n.endswith("conv1.weight") or n.endswith("conv2.weight") for n in chosen)
    assert all(make("full").mask) and all(make("prunetrain").mask)


def test_prunetrain_penalty_shrinks_channel_norms(synthetic):
    plain, pruned = make("full"), make("prunetrain", prunetrain_lambda=1.0)
    for t in (plain, pruned):
        for x, y in batches(synthetic[0], BATCH, shuffle=False, input_size=INPUT):
            t.train_step(x, y)
            if t.step_count == 10:
                break

    def norm(t: Trainer) -> float:
        return float(t.model.layer4[1].conv2.weight.detach().flatten(1).norm(dim=1).sum())

    assert norm(pruned) < 0.97 * norm(plain)


def test_reselection_tensors_leave_and_rejoin_with_momentum_kept(synthetic, size_profile):
    t = make(profile=size_profile, rho=0.6)
    x, y = first_batch(synthetic)
    t.set_mask([True] * len(t.names))
    t.train_step(x, y)  # every tensor gets a momentum buffer
    head = t.names.index("fc.weight")
    t.set_mask([k != head for k in range(len(t.names))])
    momentum = t.optimizer.state[t.params[head]]["momentum_buffer"].clone()
    weight = t.params[head].detach().clone()
    t.train_step(x, y)
    assert torch.equal(t.params[head], weight)  # frozen: not even weight decay or momentum moved it
    assert torch.equal(t.optimizer.state[t.params[head]]["momentum_buffer"], momentum)
    t.set_mask([True] * len(t.names))
    t.train_step(x, y)
    assert not torch.equal(t.params[head], weight)


def test_selection_fits_budget_and_memory_does_not_grow(synthetic, size_profile):
    t = make(profile=size_profile, rho=0.5, interval=1, interval_unit="step")
    counts = []
    for x, y in batches(
        synthetic[0], BATCH, shuffle=True, generator=torch.Generator().manual_seed(1), input_size=INPUT
    ):
        t.reselect(t.probe_batch(synthetic[0]))
        t.train_step(x, y)
        counts.append(sum(p.grad is not None for p in t.params))
        assert counts[-1] == sum(t.mask)  # frozen tensors hold no gradient buffers
        assert size_profile.step_time(t.mask) <= 0.5 * size_profile.full_step_time + 1e-12
        if len(t.selections) == 12:
            break
    assert len(t.optimizer.state) <= len(t.params)
    assert len({tuple(s.mask) for s in t.selections}) > 1  # the selection really changes


def test_proportional_profile_fits_the_model_and_selects_the_same_everywhere(synthetic, size_profile):
    trainer = make(profile=size_profile)
    shapes = [list(p.shape) for p in trainer.params]
    size_profile.check_matches(trainer.names, shapes, batch_size=BATCH, input_size=INPUT)  # raises on a mismatch
    assert size_profile == proportional_profile(small_model(seed=3))  # sizes only: weights and machine do not matter
    dw = size_profile.t_dw
    head = [k for k, t in enumerate(size_profile.tensors) if t.name.startswith("fc.")]
    assert dw[head[0]] == pytest.approx(512 * 10 * 1e-8) and dw[head[1]] == pytest.approx(10 * 1e-8)
    assert sum(t.t_dy > 0 for t in size_profile.tensors) == len({t.layer for t in size_profile.tensors})
    # Same model, same probe batch, same profile: the same selection, step for step.
    masks = []
    for _ in range(2):
        t = make(profile=size_profile, rho=0.4)
        masks.append(t.reselect(first_batch(synthetic)).mask)
    assert masks[0] == masks[1] and 0 < sum(masks[0]) < len(masks[0])


def test_rho_below_forward_floor_is_refused(size_profile):
    assert size_profile.min_rho == pytest.approx(0.15)
    with pytest.raises(BudgetError, match=r"train.rho: 0.1 is below this device's floor 0.150 .* use rho >= 0.15"):
        make(profile=size_profile, rho=0.1)
    make(profile=size_profile, rho=0.15 + 1e-9)  # at the floor: accepted


def test_elastic_learns_and_writes_record(tmp_path, synthetic, size_profile, capsys):
    # A size-proportional profile: a measured one, taken under heavy load, once made rho 0.5
    # select too little to pass 30%.
    profile_path = size_profile.save(tmp_path / "p.yaml")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"name: t\noutput_dir: {tmp_path}\nmodel: {{name: resnet18, in_channels: 1}}\n"
        f"data: {{dataset: synthetic, input_size: {INPUT}, train_per_class: 40, test_per_class: 30}}\n"
        f"train: {{epochs: 2, batch_size: {BATCH}, rho: 0.5, lr: 0.05}}\nhardware: {{profile: {profile_path}}}\n"
    )
    assert main(["train", "-c", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "epoch 2/2" in out
    record = json.loads((tmp_path / "t" / "train-elastic-rho0.5.json").read_text())
    assert record["final_accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert len(record["epochs"]) == 2 and record["train_time_s"] > 0
    assert record["epochs"][0]["predicted_time_s"] > 0
    assert len(record["selections"]) == 2
    assert all(s["predicted_step_time_s"] <= 0.5 * record["profile"]["t_full_s"] + 1e-9 for s in record["selections"])
    assert 0 < record["probe_time_s"] < record["train_time_s"]  # the probes' share is reported
    assert record["probe_share"] == pytest.approx(record["probe_time_s"] / record["train_time_s"])


def test_a_probe_uses_probe_samples_of_a_fresh_batch(synthetic, size_profile):
    whole = make(profile=size_profile, seed=3).probe_batch(synthetic[0])
    few = make(profile=size_profile, seed=3, probe_samples=4).probe_batch(synthetic[0])
    assert len(whole[1]) == BATCH and len(few[1]) == 4
    assert torch.equal(few[0], whole[0][:4])


def test_memory_budget_plans_per_selection_and_keeps_results(tmp_path, synthetic):
    from fleet.memory.budgeted import MemoryBudget

    # Batch 32 at 32x32: the size the planner's targets are set for (tiny steps are dominated by
    # tensors too small to page).
    train = TrainConfig(method="full", batch_size=32)
    plain = Trainer(small_model(), train, input_size=32)
    budgeted = Trainer(small_model(), train, input_size=32)
    probe = MemoryBudget.measure(budgeted.model, (32, 1, 32, 32), 1000.0, str(tmp_path))
    budget = int(0.5 * probe.profile.unconstrained_peak_bytes)
    budgeted.memory = MemoryBudget(probe.profile, budget, str(tmp_path))
    x, y = next(batches(synthetic[0], 32, shuffle=False, input_size=32))
    for t in (plain, budgeted):
        t.train_step(x, y)
    for a, b in zip(plain.params, budgeted.params):
        assert torch.allclose(a, b, atol=1e-5)
    (runner,) = budgeted.memory._runners.values()
    assert 0 < runner.peak_bytes <= budget
    # A selection that freezes the input side gets its own, cached plan.
    budgeted.set_mask([k >= len(budgeted.names) - 6 for k in range(len(budgeted.names))])
    budgeted.train_step(x, y)
    assert len(budgeted.memory.plans) == 2
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # spill files are cleaned up


def test_a_pass_leaves_out_a_last_batch_of_one_sample(synthetic, size_profile):
    """BatchNorm cannot train on one sample: a device holding one more than a multiple of the batch size
    trains its full batches and leaves a different sample out each pass, instead of failing its round."""
    t = make(profile=size_profile)
    data = synthetic[0].subset(list(range(2 * BATCH + 1)))
    sizes = [len(y) for _, y in t.shuffled_batches(data)]
    assert sizes == [BATCH, BATCH]
    for x, y in t.shuffled_batches(data):
        t.train_step(x, y)  # no "Expected more than 1 value per channel"
    assert [len(y) for _, y in t.shuffled_batches(synthetic[0].subset(list(range(BATCH + 2))))] == [BATCH, 2]


def test_a_pass_leaves_out_a_last_batch_under_a_quarter_of_the_batch(synthetic, size_profile):
    """Two or three samples give BatchNorm noise for statistics (a 34-sample device at batch 32 drove a
    ResNet-18's running_var to 4e5 in 10 steps): at batch 32 a last batch of 2 or 7 is left out, 8 trains,
    and a device holding less than one batch still trains on all of it."""
    t = Trainer(small_model(), TrainConfig(batch_size=32), size_profile, input_size=INPUT)

    def sizes(n: int) -> list[int]:
        return [len(y) for _, y in t.shuffled_batches(synthetic[0].subset(list(range(n))))]

    assert sizes(34) == [32]
    assert sizes(39) == [32]
    assert sizes(40) == [32, 8]
    assert sizes(7) == [7]
    data = synthetic[0].subset(list(range(34)))
    totals = {round(float(sum(x.sum() for x, _ in t.shuffled_batches(data))), 2) for _ in range(4)}
    assert len(totals) > 1  # the samples left out change from pass to pass


def test_a_training_probe_scores_its_own_kept_update_and_trains_the_selection(synthetic, size_profile):
    t = make(profile=size_profile, rho=0.5, probe="train", seed=2)
    x, y = first_batch(synthetic)
    t.train_step(x, y)
    evens = [k % 2 == 0 for k in range(len(t.names))]
    t.set_mask(evens)
    t.train_step(x, y)  # the odd tensors' momentum is now a step old
    start = [p.detach().clone() for p in t.params]
    # What the probe should score: one step on every tensor (a frozen one's momentum started afresh,
    # so its update is its plain gradient step), then every gradient at the updated weights.
    twin = make(profile=size_profile, rho=0.5, seed=2)
    twin.model.load_state_dict(t.model.state_dict())
    twin.optimizer.load_state_dict(copy.deepcopy(t.optimizer.state_dict()))  # else they share buffers
    for p, even in zip(twin.params, evens):
        if not even:
            twin.optimizer.state.pop(p)
    twin.set_mask([True] * len(twin.names))
    twin.train_step(x, y)
    update = [p.detach() - s for p, s in zip(twin.params, start)]
    grads = torch.autograd.grad(torch.nn.functional.cross_entropy(twin.model(x), y), twin.params)
    expected = [-float((g * dw).sum()) for g, dw in zip(grads, update)]
    top = max(abs(v) for v in expected)
    after_one = [p.detach().clone() for p in twin.params]
    losses = t.training_probe(x, y, epoch=0)
    selection = t.selections[-1]
    assert len(losses) == 2 and t.step_count == 4
    assert selection.importance == pytest.approx([v / top for v in expected], rel=1e-3, abs=1e-5)
    assert 0 < sum(selection.mask) < len(selection.mask)
    assert size_profile.step_time(selection.mask) <= 0.5 * size_profile.full_step_time + 1e-12
    for p, first, chosen in zip(t.params, after_one, selection.mask):
        assert torch.equal(p, first) != chosen  # the second step moves exactly the tensors it selected


def test_an_epoch_with_training_probes_counts_their_steps_and_their_extra_cost(synthetic, size_profile):
    data = dataclasses.replace(synthetic[0], images=synthetic[0].images[:80], labels=synthetic[0].labels[:80])
    t = make(profile=size_profile, rho=0.5, probe="train")
    stats = [t.train_epoch(data, epoch) for epoch in range(2)]
    batches_per_epoch = len(list(t.shuffled_batches(data)))
    assert [s.steps for s in stats] == [batches_per_epoch + 1] * 2  # the probe's batch is trained twice
    assert [s.step for s in t.selections] == [1, batches_per_epoch + 2]
    full, elastic = size_profile.full_step_time, size_profile.step_time(t.selections[0].mask)
    assert stats[0].predicted_time_s == pytest.approx(2 * full + (batches_per_epoch - 1) * elastic)
    assert all(0 < s.probe_time_s < s.train_time_s for s in stats)
    restore = make(profile=size_profile, rho=0.5, probe="restore")
    restored = restore.train_epoch(data, 0)
    assert restored.steps == batches_per_epoch
    elastic = size_profile.step_time(restore.mask)
    assert restored.predicted_time_s == pytest.approx(2 * full + batches_per_epoch * elastic)


def test_frozen_norm_stats_keep_the_statistics_the_model_came_with_and_still_train(synthetic, size_profile):
    data = dataclasses.replace(synthetic[0], images=synthetic[0].images[:40], labels=synthetic[0].labels[:40])
    moved = {}
    for frozen in (False, True):
        t = make("full", profile=size_profile, frozen_norm_stats=frozen)
        stats = {k: v.clone() for k, v in t.model.state_dict().items() if "running" in k}
        weight = t.model.bn1.weight.detach().clone()
        t.train_epoch(data, 0)
        t.evaluate(data)
        moved[frozen] = any(not torch.equal(v, t.model.state_dict()[k]) for k, v in stats.items())
        assert not torch.equal(t.model.bn1.weight, weight)  # the norms' own weights train either way
        assert t.model.training and t.model.bn1.training != frozen  # evaluation hands training back as it was
    assert moved == {False: True, True: False}
