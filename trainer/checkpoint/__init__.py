"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of one run directory:

    checkpoints/
      step_000012/            a complete checkpoint (published by one rename)
        .metadata             DCP's index of every tensor (written by rank 0)
        __0_0.distcp ...      DCP tensor shards (every rank writes its own)
        trainer_state.json    step, tokens, best val loss, every rank's loader position and RNG states,
                              the global batch and its parts, the data's and tokenizer's identity
        config.json           the resolved config of the run that wrote it
        COMPLETE              the completion marker, written last: every other file's size and
                              checksum ("xxh3_128:<hex>"; integrity.py), verified before any load
      .tmp_step_000016/       a save in progress (ignored and removed on the next start)
      corrupt_step_000015/    a checkpoint that failed verification, set aside by resume=auto
                              (kept for inspection, never resumed, never deleted by retention)

The DCP part holds tensors only: `model.<fqn>` (the model's parameters, full or sharded by the
strategy) and `optim.<fqn>.<name>` (AdamW's per-parameter state, keyed by parameter name so it
reshards across world sizes and modes). Everything else is JSON. Loading never unpickles an
arbitrary object: tensor data goes through torch.load(weights_only=True) inside DCP, and DCP's
`.metadata` index is read with an unpickler that only admits DCP's own metadata classes.

Only global rank 0 writes outside the DCP shard files: it creates the temporary folder, writes
the JSON files and the marker, renames the folder into place, and deletes old checkpoints. Each
rank hashes the shard files it wrote and sends the checksums to rank 0 for the marker.

Modules, one job each (this file imports none of them, so `trainer.checkpoint.layout` stays
torch-free for the run-directory checks that run before torch is imported):

    layout    names of the files and folders above; finding complete checkpoints (standard library)
    integrity every file's checksum in the marker, and verifying them (standard library)
    records   its JSON records read and checked without torch (and the model fields a resume must
              match); the checkpoint resume=auto will load
    verify    reading a checkpoint safely and checking it before anything is loaded
    selection which checkpoint a resume loads: newest intact first, corrupt ones set aside
    rng       every rank's RNG states as JSON
    manager   the Checkpointer: save, restore, retention and async saves during training
    finite    whether a state's tensors are all finite (before a save; after a weights read)
    space     room for the next checkpoint, checked before the work is lost (standard library)
    deferred  torch.distributed.checkpoint, imported at the first save, restore or weights read

Whether a continuation may go on from a checkpoint is a preflight check: trainer/preflight/continuation.py.
A checkpoint's weights read outside a training run (eval, sample, export, model.init_from) are
trainer/weights/'s; Hugging Face's formats are trainer/huggingface/'s.

torch.distributed.checkpoint itself (with DTensor and sympy under it, about 0.7 s) is imported at
the first save or restore, where it is used (manager, selection; trainer/weights/): a run that
starts fresh trains its first step without it (tests/system/test_startup.py).
"""
