"""The vendor's pretrained model: which seed makes it, and a cache that never hands one seed's model to another."""

from __future__ import annotations

import dataclasses

from fleet.engine.config import load_config
from fleet.engine.pretrain import checkpoint_path, pretrain_config

CONFIG = "simulations/personalize.yaml"


def unfixed(cfg):
    """``cfg`` with no pretrain seed of its own: pretraining follows train.seed."""
    return dataclasses.replace(cfg, pretrain=dataclasses.replace(cfg.pretrain, seed=None))


def test_the_cached_model_is_named_by_the_seed_that_made_it():
    own = [unfixed(load_config(CONFIG, {"train.seed": s})) for s in (0, 1)]
    assert checkpoint_path(own[0]) != checkpoint_path(own[1])
    assert [pretrain_config(c).train.seed for c in own] == [0, 1]


def test_a_fixed_pretrain_seed_gives_every_personalization_seed_one_model():
    runs = [load_config(CONFIG, {"train.seed": s}) for s in (0, 1, 2)]  # the bench's config fixes pretrain.seed 0
    assert len({checkpoint_path(c) for c in runs}) == 1
    assert {pretrain_config(c).train.seed for c in runs} == {0}
    assert checkpoint_path(runs[0]).name.endswith("-r0.pt")
