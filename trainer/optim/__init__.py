"""Building optimizers: which parameter goes to which optimizer, the optimizers themselves, and the
learning-rate schedule.

- build.py       the split by role (Muon / the elementwise optimizer), parameter groups, and
                 build_optimizer, which asks the run's Strategy how to run each optimizer
- registry.py    an optimizer is one registration: OPTIMIZER in NAME.py (with conf/optim/NAME.yaml),
                 found by optim.name (class, keyword arguments, state per parameter)
- adamw.py       AdamW's registration
- lion.py        Lion (sign of interpolated momentum), dtrain's own, and its registration
- muon.py        Muon's step over stacks of same-shape matrices (batched), and its registration
- schedule.py    warmup, then cosine / wsd / linear decay

This file imports nothing, so importing one of these modules loads only what it needs.
"""
