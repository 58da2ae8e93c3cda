"""dtrain: one train/eval loop for GPT-2-style models under single, DP, DDP, ZeRO and FSDP."""

import os

__version__ = "0.1.0"

# Bitwise-exact resume on CPU needs every op to run on the same number of threads in a run and in
# its continuation. MKL (MKL_DYNAMIC is TRUE by default) and libgomp with OMP_DYNAMIC=true size
# their thread teams from the machine's load, so a busy machine silently changes the arithmetic.
# Both are read once, when the runtime starts: set here, before anything imports torch, and
# inherited by every worker process. (A fixed count per process: runtime.init_runtime.)
os.environ.setdefault("OMP_DYNAMIC", "FALSE")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
# MKL's conditional numerical reproducibility: without it Intel promises equal results run to run
# only for aligned data and an undisturbed schedule; AUTO keeps the fastest code path for this CPU
# (matmuls of gpt2_124m's and cpu_small's shapes measured at the same GFLOP/s on and off).
os.environ.setdefault("MKL_CBWR", "AUTO")
