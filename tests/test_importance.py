"""The importance probe measures and then leaves no trace."""

import pytest
import torch

from fleet.data.datasets import batches
from fleet.engine import importance
from fleet.engine.config import TrainConfig
from fleet.engine.importance import (
    evaluate_importance,
    importance_from_momentum,
    importance_from_update,
    momentum_readable,
    normalize,
)
from fleet.engine.trainer import make_optimizer
from tests.conftest import INPUT, small_model


def _setup(synthetic):
    model = small_model()
    params = list(model.parameters())
    opt = make_optimizer(params, TrainConfig())
    gen = torch.Generator().manual_seed(0)
    it = batches(synthetic[0], 8, shuffle=True, generator=gen, input_size=INPUT)
    # A few real steps so momentum buffers exist.
    for _ in range(3):
        x, y = next(it)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, params, opt, next(it)


def test_probe_restores_weights_buffers_optimizer_and_flags(synthetic):
    model, params, opt, (x, y) = _setup(synthetic)
    params[0].requires_grad_(False)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_momentum = [opt.state[p]["momentum_buffer"].clone() for p in params]
    flags = [p.requires_grad for p in params]
    imp = evaluate_importance(model, params, opt, x, y)
    assert len(imp) == len(params)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_state[k]), k  # includes BN running stats
    for p, m in zip(params, before_momentum):
        assert torch.equal(opt.state[p]["momentum_buffer"], m)
    assert [p.requires_grad for p in params] == flags
    # And training afterwards behaves exactly as if no probe had happened.
    twin, twin_params, twin_opt, _ = _setup(synthetic)
    twin_params[0].requires_grad_(False)
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    for a, b in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.allclose(a, b)


def test_probe_on_fresh_model_leaves_no_optimizer_state(synthetic):
    model = small_model()
    params = list(model.parameters())
    opt = make_optimizer(params, TrainConfig())
    x, y = next(batches(synthetic[0], 8, shuffle=False, input_size=INPUT))
    evaluate_importance(model, params, opt, x, y)
    assert len(opt.state) == 0


def test_importance_values(synthetic):
    model, params, opt, (x, y) = _setup(synthetic)
    imp = evaluate_importance(model, params, opt, x, y)
    assert max(abs(v) for v in imp) == 1.0
    assert sum(v > 0 for v in imp) > len(imp) // 2  # a descent step helps most tensors


def test_formula_and_normalization():
    g = [torch.tensor([1.0, 2.0]), None, torch.tensor([-1.0])]
    dw = [torch.tensor([-0.5, -0.5]), torch.tensor([3.0]), torch.tensor([-2.0])]
    assert importance_from_update(g, dw) == [1.5, 0.0, -2.0]
    assert normalize([1.5, 0.0, -2.0]) == [0.75, 0.0, -1.0]
    assert normalize([0.0, 0.0]) == [0.0, 0.0]


def test_momentum_is_readable_only_for_sgd_whose_step_is_its_buffer():
    params = list(small_model().parameters())
    assert momentum_readable(make_optimizer(params, TrainConfig()))
    assert not momentum_readable(torch.optim.SGD(params, lr=0.1))  # no momentum: no buffer
    assert not momentum_readable(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True))
    assert not momentum_readable(torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5))
    assert not momentum_readable(torch.optim.Adam(params, lr=0.1))


def test_the_update_read_from_momentum_is_the_weights_change(synthetic):
    """After a step on buffers that already exist, and on fresh ones (weight decay in both), ``-lr * buf``
    scores as the weights' own change does."""
    model, params, opt, (x, y) = _setup(synthetic)
    for fresh in (False, True):
        if fresh:
            opt.state.clear()
        before = [p.detach().clone() for p in params]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
        from_weights = importance_from_update(grads, [p.detach() - b for p, b in zip(params, before)])
        from_momentum = importance_from_momentum(grads, opt, params)
        top = max(abs(v) for v in from_weights)
        assert top > 0
        assert [v / top for v in from_momentum] == pytest.approx([v / top for v in from_weights], abs=1e-4)


def test_the_restoring_probe_scores_alike_with_or_without_the_copy(synthetic, monkeypatch):
    model, params, opt, (x, y) = _setup(synthetic)
    read = evaluate_importance(model, params, opt, x, y)
    monkeypatch.setattr(importance, "momentum_readable", lambda optimizer: False)
    copied = evaluate_importance(model, params, opt, x, y)
    assert read == pytest.approx(copied, abs=1e-4) and max(read) == 1.0
