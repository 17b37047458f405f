"""The adaptive attacks of ``fleet bench robustness`` (fleet/bench/attacks.py): each one does what its paper
says, on small updates where the figures can be checked by hand."""

from __future__ import annotations

import pytest
import torch

from fleet.bench import attacks
from fleet.data.datasets import ArrayDataset


def honest_updates() -> list[attacks.Update]:
    """Four honest devices; "w" trained by all, "rare" by one, "mid" by two."""
    return [
        {"w": torch.tensor([1.0, 2.0, 0.0]), "rare": torch.tensor([0.5, 0.5]), "mid": torch.tensor([1.0])},
        {"w": torch.tensor([3.0, 2.0, 0.0]), "mid": torch.tensor([3.0])},
        {"w": torch.tensor([1.0, 4.0, 0.0])},
        {"w": torch.tensor([3.0, 4.0, 4.0])},
    ]


OWN = {"w": torch.tensor([2.0, 3.0, 1.0]), "rare": torch.tensor([1.0, 0.0]), "mid": torch.tensor([2.0])}


def test_alie_is_the_honest_mean_minus_z_standard_deviations_per_coordinate():
    out = attacks.alie(OWN, honest_updates(), z=1.0)
    assert torch.allclose(out["w"], torch.tensor([2.0 - 1.0, 3.0 - 1.0, 1.0 - 3**0.5]))
    assert torch.allclose(out["mid"], torch.tensor([2.0 - 1.0]))
    assert torch.equal(out["rare"], OWN["rare"])  # one honest sender: no spread to hide in, its own update


def test_ipm_reverses_the_honest_mean_by_eps():
    out = attacks.ipm(OWN, honest_updates(), eps=0.1)
    assert torch.allclose(out["w"], -0.1 * torch.tensor([2.0, 3.0, 1.0]))
    assert torch.allclose(out["rare"], torch.tensor([-0.05, -0.05]))


def test_min_max_stays_within_the_honest_spread_and_goes_as_far_as_it_allows():
    honest = honest_updates()
    out = attacks.min_max(OWN, honest)
    stack = torch.stack([u["w"] for u in honest])
    limit = float(torch.cdist(stack, stack).max())
    farthest = float((stack - out["w"]).norm(dim=1).max())
    assert farthest <= limit + 1e-9 and farthest > 0.999 * limit  # on the edge of the honest spread
    mean, std = stack.mean(0), stack.std(0, unbiased=False)
    gamma = float((mean - out["w"])[0] / std[0])
    assert gamma > 0 and torch.allclose(out["w"], mean - gamma * std)


def test_min_max_unheld_poisons_the_large_tensors_not_held_alone_and_nothing_else():
    def update(shift: float) -> attacks.Update:
        shapes = {"conv": (32, 32), "bn.weight": (600,), "fc.weight": (16, 40), "fc.bias": (16,)}
        return {name: torch.full(shape, 1.0 + shift) for name, shape in shapes.items()}

    honest, own = [update(s) for s in (0.0, 1.0, 2.0, -1.0)], update(0.5)
    out, min_max = attacks.min_max_unheld(own, honest, 2.0), attacks.min_max(own, honest, 2.0)
    for name in ("bn.weight", "fc.weight"):  # 600 and 640 values, left to the medians: the classifier, a vector
        assert torch.equal(out[name], min_max[name]) and not torch.equal(out[name], own[name])
    for name in ("conv", "fc.bias"):  # held to the sign skew on its own; too small to be
        assert torch.equal(out[name], own[name])


def test_under_bound_scales_each_tensor_just_below_the_bound_an_attacker_expects():
    out = attacks.under_bound(OWN, honest_updates())
    norms = sorted(float(u["w"].norm()) for u in honest_updates())
    assert float(out["w"].norm()) == pytest.approx(0.9 * 3.0 * norms[1])  # lower median of four
    assert float(out["rare"].norm()) == pytest.approx(0.9 * 3.0 * 0.5**0.5)
    direction = torch.nn.functional.cosine_similarity(out["w"], OWN["w"], dim=0)
    assert float(direction) == pytest.approx(1.0)


def test_mask_abuse_claims_only_the_least_trained_tensors_reversed_and_enlarged():
    honest = honest_updates()
    assert attacks.rarest(honest, ["w", "rare", "mid"]) == ["rare"]
    assert attacks.rarest(honest, ["w", "mid", "unseen"]) == ["unseen"]  # nobody honest trained it
    out = attacks.mask_abuse(OWN, honest, ["w", "rare", "mid"], scale=10.0)
    assert set(out) == {"rare"}
    assert float(out["rare"].norm()) == pytest.approx(10 * 0.5**0.5)
    assert torch.allclose(out["rare"] / out["rare"].norm(), -torch.tensor([0.5, 0.5]) / 0.5**0.5)


def data(n: int = 40) -> ArrayDataset:
    images = torch.zeros(n, 1, 28, 28, dtype=torch.uint8)
    return ArrayDataset(images, torch.arange(n) % 10, 10, (0.5,), (0.5,), "test")


def test_label_flip_maps_each_label_to_its_mirror():
    assert attacks.flip_labels(data()).labels[:10].tolist() == list(range(9, -1, -1))


def test_the_trigger_is_a_white_square_three_input_pixels_wide():
    out = attacks.trigger(torch.zeros(2, 1, 28, 28, dtype=torch.uint8), input_size=16)
    side = round(3 * 28 / 16)
    assert int((out[0, 0] == 255).sum()) == side * side
    assert bool((out[:, :, 22:27, 22:27] == 255).all()) and int(out[:, :, :22].sum()) == 0


def test_backdoor_data_triggers_and_relabels_half_the_samples():
    clean = data()
    poisoned = attacks.backdoor_data(clean, 16, seed=0)
    changed = (poisoned.images != clean.images).flatten(1).any(1)
    assert int(changed.sum()) == 20
    assert bool((poisoned.labels[changed] == attacks.BACKDOOR_TARGET).all())
    assert torch.equal(poisoned.labels[~changed], clean.labels[~changed])


def test_the_triggered_test_set_leaves_out_the_target_class():
    test = attacks.triggered_test(data(), 16)
    assert len(test.labels) == 36 and bool((test.labels == attacks.BACKDOOR_TARGET).all())
    assert bool((test.images[:, :, 22:27, 22:27] == 255).all())
