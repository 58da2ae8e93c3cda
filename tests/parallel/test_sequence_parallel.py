"""Sequence parallelism under parallel.tp (trainer/parallel/tensor_parallel.py): each tp rank holds
its positions of the residual stream, and one forward and backward split that way over two gloo ranks
gives the whole model's loss, gradients, per-token losses and (without targets, the stream whole)
logits, for GPT-2 blocks, Llama blocks with GQA and QK-norm under activation checkpointing and a
chunked loss, and a mixture of experts' layers (routed whole, their aux loss the whole sequence's).
"""

from __future__ import annotations

import pytest
from helpers.dist_workers import every_rank, sequence_parallel_differences

GPT2_BLOCKS = dict(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_embd=32)
LLAMA_BLOCKS = dict(GPT2_BLOCKS, n_kv_head=2, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                    tie_embeddings=False, qk_norm=True)
MOE_BLOCKS = dict(LLAMA_BLOCKS, mlp_multiple_of=32, moe={"num_experts": 4, "top_k": 2, "expert_hidden": 16})


# fp64 but the cross-entropy (fp32 in the model; the chunked loss's pieces of logits) and the MoE
# router (its softmax in fp32): the gradients' tolerance is the fp32 parts' rounding
@pytest.mark.parametrize(("blocks", "activation_checkpointing", "loss_chunks", "grads"), [
    (GPT2_BLOCKS, False, 1, 1e-12),
    (LLAMA_BLOCKS, True, 2, 1e-6),
    (MOE_BLOCKS, False, 1, 1e-9),
], ids=["gpt2", "llama_checkpointed_chunked", "moe"])
def test_split_positions_compute_the_whole_models_loss_and_gradients(blocks, activation_checkpointing,
                                                                     loss_chunks, grads, tmp_path):
    ranks = every_rank(sequence_parallel_differences, 2, blocks, activation_checkpointing, loss_chunks)
    seq = blocks["block_size"]
    for rank, worst in ranks.items():
        # the forwards with targets (training, per-token) ran on half the positions; without, whole
        assert worst["positions"] == [seq // 2] * (1 + activation_checkpointing) + [seq // 2, seq], (rank, worst)
        assert worst["loss"] < 1e-6 and worst["per_token"] < 1e-6, (rank, worst)
        assert worst["logits"] < 1e-12, (rank, worst)
        assert worst["grads"] < grads, (rank, worst)
