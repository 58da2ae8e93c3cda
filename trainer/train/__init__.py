"""The worker: bring-up and teardown (worker.py), the one train/eval loop (loop.py), the
non-finite guard, the step bookkeeping and time to target.
"""
