"""Worker side of a run: process group, device, threads, rank info and teardown."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainer.errors import ConfigError, UserError
from trainer.process.env import restart_count
from trainer.process.mesh_shape import MeshShape


@dataclass
class Runtime:
    rank: int
    local_rank: int
    world: int
    local_world: int
    device: torch.device
    distributed: bool  # a process group is up (also at world 1 for zero/fsdp)
    # How the world is laid out (trainer/process/mesh_shape.py); every rank data-parallel unless told
    shape: MeshShape = field(default=None)  # type: ignore[assignment]

    def __post_init__(self):
        if self.shape is None:
            self.shape = MeshShape(dp_shard=self.world)
        if self.shape.world != self.world:
            raise ConfigError(f"the mesh {self.shape.describe()} holds {self.shape.world} ranks, but "
                              f"{self.world} workers started; make the parallel sizes multiply to world")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which data-parallel batch this rank reads (ranks of one tensor-parallel group share it)."""
        return self.shape.dp_rank(self.rank)

    @property
    def dp_world(self) -> int:
        """How many different batches one micro step reads (world without the model-parallel ranks)."""
        return self.shape.dp_world

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean over ranks (a no-op without a process group)."""
        if self.distributed and self.world > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= self.world
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed and self.world > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if self.distributed and self.world > 1:
            dist.barrier()

    def broadcast_object(self, obj, src: int = 0):
        if not (self.distributed and self.world > 1):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def agree(self, problem: str | None, error: type[UserError] = UserError) -> None:
        """Rank 0's problem (or None) reaches every rank, and all raise together: a check that only
        rank 0 can make (it owns the run directory) fails the job on every rank, not a hang."""
        problem = self.broadcast_object(problem)
        if problem:
            raise error(problem)

    def from_main(self, work, error: type[UserError] = UserError):
        """Rank 0 runs `work()`; its result reaches every rank, or its UserError is raised on all."""
        result = problem = None
        if self.is_main:
            try:
                result = work()
            except UserError as err:
                problem = str(err)
        result, problem = self.broadcast_object((result, problem))
        if problem:
            raise error(problem)
        return result

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj`, in rank order (just [obj] in one process)."""
        if not (self.distributed and self.world > 1):
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def shutdown(self, barrier: bool = True) -> None:
        """Tear the process group down. `barrier=False` after an interrupt (spawn's parent-death
        SIGINT arrives as KeyboardInterrupt wherever a rank is): a barrier then can meet a peer
        still inside another collective and wait out the whole process-group timeout."""
        if dist.is_initialized():
            # A barrier first: gloo can abort at exit when one rank tears down while another
            # is still in flight (measured: 1/10 runs without it, 0/20 with it).
            if barrier:
                try:
                    dist.barrier()
                except Exception:  # a peer already died; nothing left to wait for
                    pass
            dist.destroy_process_group()


def pick_device(spec: str, local_rank: int) -> torch.device:
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device={spec} but no CUDA device is visible; use train.device=cpu")
        if device.index is None:
            device = torch.device(f"cuda:{local_rank}")
    return device


def _process_group_store(timeout: timedelta):
    """The store to rendezvous on, namespaced by restart attempt under torchelastic.

    After an elastic restart the agent's store still holds the dead attempt's addresses; a
    plain init_process_group reads them and hangs or fails about half the time. A prefix per
    attempt keeps each attempt's keys apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"dtrain_attempt_{restart_count()}", store)


# torch's own gloo group class, kept before _gloo_groups_on_one_thread rebinds the module's name
_TorchGloo = distributed_c10d.ProcessGroupGloo


class _OneThreadGloo(_TorchGloo):
    """A gloo group that runs its collectives on one worker thread per device, not torch's two.

    With two, a group's next collective starts on the second thread while the first thread is
    still tearing down the one before: a tensor-parallel worker crashed there about once in
    forty 16-step runs (SIGSEGV; a core dump showed one thread in ~AsyncScatterWork and the
    other releasing a gloo UnboundBuffer in the next scatter). The second thread could overlap
    two of one group's collectives (DDP's buckets, FSDP's prefetch), but ddp and fsdp at world 2
    trained no slower without it (measured 2026-11-29).
    Devices are torch's own: one per GLOO_SOCKET_IFNAME interface, else the default one.
    """

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        options = _TorchGloo._Options()
        interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
        options._devices = ([_TorchGloo.create_device(interface=name) for name in interfaces]
                            or [_TorchGloo.create_default_device()])
        options._threads = len(options._devices)
        options._timeout = timeout
        super().__init__(store, rank, size, options)


def _gloo_groups_on_one_thread() -> None:
    """Every gloo group made from now on (the world, the mesh's, new_group's) is a _OneThreadGloo:
    torch builds them all through this one module-level name."""
    distributed_c10d.ProcessGroupGloo = _OneThreadGloo


def init_runtime(device_spec: str, needs_process_group: bool, timeout_s: int, threads: int | None,
                 shape: MeshShape | None = None) -> Runtime:
    """Bring up this worker: device, CPU threads, and the process group when one is needed;
    `shape` lays the world out (None: every rank data-parallel)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = pick_device(device_spec, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # torchrun sets OMP_NUM_THREADS=1; split the cores between this node's workers instead
        # so N workers neither oversubscribe nor idle the machine.
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world))

    distributed = needs_process_group or world > 1
    if distributed and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        _gloo_groups_on_one_thread()
        timeout = timedelta(seconds=timeout_s)
        if world == 1 and "MASTER_ADDR" not in os.environ:
            store = dist.HashStore()  # a one-process group needs no network
        else:
            store = _process_group_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
        else:
            # device_id binds NCCL's communicator to this rank's GPU (else every barrier() warns)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                    device_id=device if backend == "nccl" else None)
    return Runtime(rank, local_rank, world, local_world, device, distributed, shape)
