"""One process's place in the job: what torchrun told it (env.py), its process group, device and
threads (runtime.py), stop signals (signals.py), and the run's dtrain.log (joblog.py).
"""
