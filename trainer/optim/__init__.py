"""Building optimizers: which parameter goes to which optimizer, the optimizers themselves, and the
learning-rate schedule.

- build.py       the split by role (Muon / the elementwise optimizer), parameter groups, and
                 build_optimizer, which asks the run's Strategy how to run each optimizer
- elementwise.py the elementwise optimizers by name (AdamW, Lion): class, keyword arguments, state
- lion.py        Lion (sign of interpolated momentum), dtrain's own
- muon.py        Muon's step over stacks of same-shape matrices (batched)
- schedule.py    warmup, then cosine / wsd / linear decay

This file imports nothing, so importing one of these modules loads only what it needs.
"""
