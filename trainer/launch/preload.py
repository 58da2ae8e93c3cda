"""The launch's forkserver imports this first (trainer/launch/forkserver.py): what every training
worker imports before its first step, with the garbage collector paused (trainer/process/collector.py
says why). It stays paused for the entrypoint's module, which the forkserver imports next; each
worker it forks turns it on again with all of that frozen (forkserver.release), and the forkserver
itself only forks."""

import gc

gc.disable()

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401
import torch.distributed.elastic.multiprocessing.api  # noqa: E402, F401

import trainer.launch.workers  # noqa: E402, F401
