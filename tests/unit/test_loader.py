import numpy as np
import pytest
import torch

from trainer.data.loader import ShardLoader
from trainer.errors import DataError


def shards(tmp_path, sizes):
    out = []
    start = 0
    for i, n in enumerate(sizes):
        path = tmp_path / f"s{i}.bin"
        np.arange(start, start + n, dtype=np.uint16).tofile(path)
        out.append(np.memmap(path, dtype=np.uint16, mode="r"))
        start += n
    return out


def make(data, rank, world, accum, B=2, T=8, seed=0):
    return ShardLoader(data, B, T, rank, world, accum, seed, torch.device("cpu"))


def step_tokens(loaders, accum):
    """The set of (x row) tuples all ranks read in one optimizer step."""
    rows = []
    for _ in range(accum):
        for loader in loaders:
            x, y = loader.next_batch()
            assert torch.equal(x[:, 1:], y[:, :-1])
            rows += [tuple(r.tolist()) for r in x]
    return rows


@pytest.mark.parametrize("world,accum", [(2, 2), (4, 1), (1, 4)])
def test_ranks_partition_the_single_process_stream(tmp_path, world, accum):
    data = shards(tmp_path, [500, 333, 700])
    single = make(data, 0, 1, 4)
    ranks = [make(data, r, world, accum) for r in range(world)]
    for _ in range(12):  # crosses shard and epoch boundaries
        expected = step_tokens([single], 4)
        got = step_tokens(ranks, accum)
        assert len(got) == len(set(got))  # no overlap between ranks
        assert sorted(got) == sorted(expected)  # union equals the single-process step


def test_micro_batch_size_does_not_change_the_rows(tmp_path):
    data = shards(tmp_path, [2000])
    big = ShardLoader(data, 8, 8, 0, 1, 1, 0, torch.device("cpu"))
    small = ShardLoader(data, 2, 8, 0, 1, 4, 0, torch.device("cpu"))
    for _ in range(5):
        assert step_tokens([big], 1) == step_tokens([small], 4)


def test_deterministic_from_seed_and_shuffles_shards(tmp_path):
    data = shards(tmp_path, [100] * 6)
    a = [make(data, 0, 1, 1, seed=3) for _ in range(2)]
    b = make(data, 0, 1, 1, seed=4)
    seq_a = [step_tokens([a[0]], 1) for _ in range(40)]
    assert seq_a == [step_tokens([a[1]], 1) for _ in range(40)]
    assert seq_a != [step_tokens([b], 1) for _ in range(40)]


def test_state_round_trip_is_exact(tmp_path):
    data = shards(tmp_path, [300, 260, 410])
    loader = make(data, 1, 2, 2)
    for _ in range(7):
        step_tokens([loader], 2)
    state = loader.state_dict()
    expected = [step_tokens([loader], 2) for _ in range(9)]
    fresh = make(data, 1, 2, 2)
    fresh.load_state_dict(state)
    assert [step_tokens([fresh], 2) for _ in range(9)] == expected
    # the position is world-independent: the same state resumes at world 4 with the same tokens
    ranks = [make(data, r, 4, 1) for r in range(4)]
    singles = make(data, 0, 1, 4)
    for loader_ in ranks + [singles]:
        loader_.load_state_dict(state)
    for _ in range(5):
        assert sorted(step_tokens(ranks, 1)) == sorted(step_tokens([singles], 4))


def test_data_too_small_is_a_clear_error(tmp_path):
    data = shards(tmp_path, [50])
    with pytest.raises(DataError, match="lower train.micro_batch_size"):
        make(data, 0, 8, 1)
