"""The step's host work: module modes are rewritten only after an evaluation (train() on every step
made torch.compile re-check every module's guards on each call)."""

from __future__ import annotations

import torch
from helpers.dtrain import tiny_args

from trainer.config.compose import compose
from trainer.fit.run import Run
from trainer.process.runtime import Runtime


def test_train_mode_is_set_only_after_an_evaluation(data_dir, tmp_path):
    overrides = tiny_args(data_dir, tmp_path / "run", "train.device=cpu", "train.val_tokens=256")[1:]
    cfg = compose([o for o in overrides if not o.startswith("hydra.")])
    rt = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)
    run = Run(cfg, rt, tmp_path / "run")
    calls = []
    model_train = run.model.train
    run.model.train = lambda mode=True: calls.append(mode) or model_train(mode)
    for step in range(3):
        run.train_step(step)
    assert calls == []  # built in training mode: nothing to rewrite
    run.val_loss()  # eval() is train(False)
    assert calls == [False] and not any(m.training for m in run.model.modules())
    run.train_step(3)
    assert calls == [False, True] and all(m.training for m in run.model.modules())
    run.train_step(4)
    assert calls == [False, True]
