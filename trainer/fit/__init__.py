"""Fitting a model on one worker: bring-up and teardown (worker.py), the one train/eval loop
(loop.py's Trainer.fit) over what a worker builds (run.py's Run), the non-finite guard, the step
bookkeeping and time to target.
"""
