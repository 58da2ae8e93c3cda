"""What the test modules share (issue 35 item 7: a test module imports `helpers`, never another test
module nor conftest.py; fixtures come from conftest.py by name). Imports nothing itself.

    dtrain        run `dtrain` as a user does; the tiny run's command line; metrics.jsonl
    runs          the shared run recipes: reference steps, every mode's overrides, checkpointed runs
    processes     a dtrain in the background: start, wait, kill, its workers and sockets (/proc)
    errors        the one-line rule as asserted: exit 2, one `error:` line, nothing written
    checkpoints   what a run leaves on disk and the weights in it
    evals         HellaSwag files and the lm-evaluation-harness tasks (offline)
    tokenizers    byte-level BPE folders made by the `tokenizers` library
    user_error_kinds  every kind of user error, raised in a worker by tests/faults/test_worker_errors.py
    dist_workers  functions the distributed tests run in torchrun's workers (importable there)
"""
