"""What a resume says before it trains when it does not go on exactly as the checkpoint was written:
the data changed since (resume=PATH continues on other data on purpose; resume=auto refuses that
before anything runs: trainer/preflight/continuation.py), or the run now takes its floating-point
sums in another order.

Floating-point addition is not associative: the same numbers summed in another order can differ in
the last bits, and training carries that forward. Settings a continuation may change (operational
keys, trainer/config/keys.py) that change the order, without changing what is summed: the threads
per worker (how a matmul or a reduction is split between threads: a crashed run continued with 1
thread instead of 2 differed from the uninterrupted run in the 8th digit of its best val loss), the
world size and parallel mode (how gradients are reduced across ranks), the micro batch and
accumulation that make the same global batch, the gradient buckets of DDP and ZeRO at world > 1,
torch.compile (fused kernels), the loss's pieces and kernel (train.loss_chunks, train.loss_kernel),
the attention's kernel (model.attention) and the device. Activation
checkpointing recomputes the same ops in the same order and keeps the weights bitwise (measured), so
it is not among them. Every checkpoint records what its run ran with (trainer_state.json: the fields
of SUM_ORDER); a continuation that runs otherwise says so in one line: its losses are not bitwise
those of an uninterrupted run, and on CPU in fp32 they stay within ~1e-5 of them (the bar the
parity tests hold every mode to). Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from trainer.data.identity import data_changes
from trainer.data.mixture import describe_data

# trainer_state.json's field -> the setting it records, as the user names it.
SUM_ORDER = {
    "device": "train.device",
    "threads_per_worker": "launch.threads_per_worker",
    "world": "world",
    "parallel": "parallel.mode",
    # the device mesh (parallel.dp_replicate, tp, cp): another layout of the same world reduces
    # gradients over other groups (and splits matrices otherwise)
    "mesh": "the device mesh",
    "micro_batch_size": "train.micro_batch_size",
    "grad_accum_steps": "accumulation",
    "bucket_cap_mb": "parallel.bucket_cap_mb",
    "compile": "train.compile",
    "loss_chunks": "train.loss_chunks",
    "loss_kernel": "train.loss_kernel",
    "attention": "model.attention",
}
BATCH_SPLIT = ("micro_batch_size", "grad_accum_steps")  # compared only under the same global batch


def ran_with(cfg, rt, plan, threads: int) -> dict:
    """How this process runs, as each checkpoint records it: its world, mode, mesh and global batch
    with what made it (the data-parallel ranks count in the batch, not the world), which a
    continuation must keep (trainer/preflight/continuation.py), and the rest of SUM_ORDER (`rt`: the
    runtime, `plan`: the batch plan, `threads`: torch's intra-op threads, which only count on a CPU)."""
    device = rt.device.type
    return {"world": rt.world, "parallel": cfg.parallel.mode, "mesh": rt.shape.describe(), "dp_world": rt.dp_world,
            "total_batch_size": plan.total_batch_size,
            "micro_batch_size": plan.micro_batch_size, "seq_len": plan.seq_len,
            "grad_accum_steps": plan.grad_accum_steps, "device": device,
            "threads_per_worker": threads if device == "cpu" else None, "bucket_cap_mb": cfg.parallel.bucket_cap_mb,
            "compile": cfg.train.compile_mode if cfg.train.compile else False, "loss_chunks": cfg.train.loss_chunks,
            "loss_kernel": cfg.train.loss_kernel, "attention": cfg.model.attention}


def sum_order_changes(saved: dict, now: dict) -> list[str]:
    """One phrase per SUM_ORDER setting the checkpoint (its trainer state) was saved with that this
    run (`now`: the same fields) runs otherwise, e.g. "launch.threads_per_worker 2 then, 1 now". A
    field the checkpoint lacks (saved before it was recorded) is not a change; the batch's split is
    compared only when the global batch is the same (another batch is another run, on purpose);
    buckets only where gradients are reduced across ranks."""
    skip = set()
    if saved.get("total_batch_size") != now.get("total_batch_size"):
        skip.update(BATCH_SPLIT)
    if saved.get("world") == now.get("world") == 1:
        skip.add("bucket_cap_mb")
    if all(_one_axis(mesh) for mesh in (saved.get("mesh"), now.get("mesh"))):
        skip.add("mesh")  # every rank data-parallel in both: the world says it all
    return [f"{name} {saved[field]} then, {now.get(field)} now" for field, name in SUM_ORDER.items()
            if field not in skip and field in saved and saved[field] != now.get(field)]


def _one_axis(mesh: str | None) -> bool:
    """Whether a recorded mesh (MeshShape.describe) is plain data parallelism over the world."""
    return mesh is None or mesh == "one rank" or (mesh.startswith("dp_shard ") and " x " not in mesh)


def resume_notes(ckpt: Path, saved: dict, now: dict, identity: dict, data_cfg) -> list[str]:
    """The lines a resume of `ckpt` (its trainer state `saved`) prints before training: `now` is
    what this run runs with (ran_with), `identity` its data's and tokenizer's (recorded_identity of
    `data_cfg`: trainer/data/identity.py)."""
    notes = []
    if changed := data_changes(saved, identity):
        notes.append(f"{ckpt} was trained on other data than {describe_data(data_cfg)} holds now: "
                     f"{'; '.join(changed)}; continuing on the new data, as resume= asks (the checkpoints it saves "
                     "record the new data)")
    if changed := sum_order_changes(saved, now):
        which = "that changes" if len(changed) == 1 else "these change"
        notes.append(f"continuing {ckpt.name} with {'; '.join(changed)}: {which} the order of floating-point "
                     "sums, so the losses will not be bitwise those of an uninterrupted run (on CPU in fp32 they stay "
                     "within ~1e-5 of them: docs/checkpoints.md#resume)")
    return notes
