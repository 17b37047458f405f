"""The importance probe measures and then leaves no trace."""

import torch

from fleet.data.datasets import batches
from fleet.engine.config import TrainConfig
from fleet.engine.importance import evaluate_importance, importance_from_update, normalize
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
