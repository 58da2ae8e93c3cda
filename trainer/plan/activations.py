"""The activation model of `dtrain plan`: the bytes one micro batch's forward keeps for the backward,
per transformer block and for the loss over the vocabulary, on a CPU and on CUDA.

It is a module of its own because it models what autograd keeps, op by op, and is fitted and
calibrated against measured peaks; it changes when the blocks, the loss or torch change. The per-mode
arithmetic that adds it to what a rank holds between steps (parameters, gradients, optimizer state,
FSDP's gathered units, the step's temporaries) is trainer/plan/memory.py.

What is counted: what forward keeps for backward per transformer block, plus the language-model head
(logits, their log-softmax and the gradients of both), which for GPT-2's 50k vocabulary is often the
largest single piece.

On a CPU the activation coefficients were fitted to measured peaks (scripts/bench.py, fp32, torch
2.13: a worker's resident-set growth); tests/cli/test_plan.py keeps the estimate within 15% of one.

On CUDA (`train.device=cuda`, or `dtrain plan --device cuda` from any host) the figures are what
`torch.cuda.max_memory_allocated` counts of them, derived from what each op keeps for the backward,
per token of a block (r = 4 bytes: the residual stream stays fp32 under bf16 autocast, a = 2 bytes:
matmul outputs in bf16; q/k/v, o and the MLP's widths from the block's shape):

* eager: the block's input and middle residual (2 r C), the bf16 casts of both norms' outputs
  that the next matmuls keep (2 a C), q/k/v (a (C + 2 kv)), SDPA's output and its contiguous
  copy (2 a C: flash/cuDNN attention keeps only O and the logsumexp, no T x T), RoPE's rotated q
  and k (a (C + kv)), and the MLP's hidden tensors (2 H for GELU: its input and output; SwiGLU 4,
  ReLU squared 3). GPT-2's block: 38 C bytes per token.
* compiled (inductor): elementwise ops are fused and recomputed in the backward from what they
  read, so only the residuals, the matmul outputs and SDPA's output stay: 2 r C + a (C + 2 kv)
  + a C + a x c_fc's width, and for SwiGLU also the gated product c_proj reads (a H). GPT-2's
  block: 24 C.
* the loss over B x T x V: eager keeps log-softmax's fp32 output, and its backward holds its
  incoming and outgoing fp32 gradients beside it (12 bytes per logit); compiled keeps the bf16
  logits and the backward holds an fp32 and a bf16 gradient (8 bytes per logit). With
  train.loss_chunks=k one piece's logits at a time (16 bytes per logit of B x T / k positions on
  CUDA, 12 on a CPU) plus the input's gradient (4 C per token) and the head weight's (fp32);
  train.loss_kernel=chunked the same, and fused as chunked in pieces of B x T x C / V positions
  (liger-kernel's chunk size). auto counts as plain (whether it is fused depends on the install).
* train.activation_checkpointing: each block keeps its fp32 input; one block's activations are
  rebuilt at a time in the backward.

tests/cli/test_plan.py (CPU) and tests/unit/test_plan_cuda.py (CUDA) check the whole estimate that
includes these figures (trainer/plan/memory.py).
"""

from __future__ import annotations

from trainer.model.config import GPTConfig

# Fitted on CPU (fp32, torch 2.13) against the resident-set peak of real runs, see the module doc.
# Kept for backward per token and block, in elements: BLOCK_ACT_PER_C x n_embd (fitted on GPT-2's
# block: 20 x n_embd in all), of which the q/k/v projection's output (3 x n_embd there) and the
# MLP's (2 x its 4 x n_embd hidden there: c_fc's output and the activation's) follow the block's
# shape: grouped KV heads narrow the first, SwiGLU keeps four hidden-wide tensors (gate, up,
# SiLU(gate), the product), ReLU squared three.
BLOCK_ACT_PER_C = 20.0
MLP_ACT_PER_HIDDEN = {"gelu": 2, "relu2": 3, "swiglu": 4}
HEAD_ACT_PER_V = 3.0  # fp32 log-softmax, its gradient and the logits' gradient, per token x vocab
# CUDA, bytes per logit (token x vocab) at backward's start (module doc): eager keeps the fp32
# log-softmax and holds its two fp32 gradients; compiled keeps the bf16 logits and holds an fp32
# and a bf16 gradient (calibrated: gpt2_124m, 32 x 1024, H100, torch 2.11)
CUDA_HEAD_EAGER, CUDA_HEAD_COMPILED = 12, 8
# train.loss_chunks on CUDA, bytes per logit of one piece: its bf16 logits and their fp32 copy, the
# softmax, the fp32 gradient and its bf16 cast (measured: gpt2_124m 32 x 1024, 4 pieces, H100:
# 15.13 GiB; 12 bytes, the CPU's fp32 figure, planned 13.22)
CUDA_CHUNK_PER_LOGIT = 16


def activation_bytes(shape: GPTConfig, t, device_type: str, act: int, tokens: int, tp: int = 1) -> int:
    """What forward keeps for backward at backward's start: the blocks and the loss over the
    vocabulary (the module doc says how, per device). Under tensor parallelism (`tp` > 1, with its
    sequence parallelism) each rank keeps 1/tp of the per-head and per-hidden-unit tensors (q/k/v,
    attention's output, the MLP's hidden ones), 1/tp of the residual stream's (its positions: the
    residuals, the norms, the checkpointed block inputs, the head's logits), and whole the two
    gathered inputs of each block's column-wise matrices, which they keep for their gradients."""
    C, L, V = shape.n_embd, shape.n_layer, shape.padded_vocab_size
    # q and attention's output are n_head x head_dim wide (n_embd unless model.head_dim sets it)
    Q, kv = shape.q_width, shape.kv_heads * shape.head_dim
    gathered = 2 * C if tp > 1 else 0  # c_attn's and c_fc's inputs, all-gathered over the positions
    if device_type == "cuda":
        residual = 4 if act == 2 else act  # autocast adds bf16 outputs to an fp32 residual stream
        if t.compile:
            # SwiGLU: gate and up, and inductor keeps their product (c_proj's input) rather than
            # recompute it (llama_135m on an H100: 2.4 H bytes a token per block more than gate + up)
            fc_out = shape.hidden * (3 if shape.mlp == "swiglu" else 1)
            per_token = 2 * residual * C // tp + act * gathered + act * (Q + 2 * kv + Q + fc_out) // tp
        else:
            rope = Q + kv if shape.pos == "rope" else 0
            # the norms' bf16 outputs the matmuls keep are the gathered inputs under tp
            norms = gathered if tp > 1 else 2 * C
            split = Q + 2 * kv + 2 * Q + rope + MLP_ACT_PER_HIDDEN[shape.mlp] * shape.hidden
            per_token = 2 * residual * C // tp + act * norms + act * split // tp
        head_per_logit = CUDA_HEAD_COMPILED if t.compile else CUDA_HEAD_EAGER
    else:
        residual = act
        qkv = Q + 2 * kv
        rest = (BLOCK_ACT_PER_C - 3 - 2 * 4) * C  # the fitted remainder: stream- or head-wide tensors
        per_token = (rest - gathered) // tp + gathered + (qkv + MLP_ACT_PER_HIDDEN[shape.mlp] * shape.hidden) // tp
        per_token *= act
        head_per_logit = HEAD_ACT_PER_V * 4  # the loss is computed in fp32
    block = per_token * tokens
    positions = tokens // tp  # of the residual stream and the head, per rank
    if t.activation_checkpointing:
        # each block keeps only its input; backward recomputes one block at a time
        blocks = L * C * residual * positions + block
    else:
        blocks = L * block
    chunks, kernel = t.get("loss_chunks", 1), t.get("loss_kernel", "auto")
    if kernel == "fused":
        # liger-kernel's rows per piece: about B x T x n_embd / vocab (its chunk size)
        chunks = -(-V // C)
    if chunks > 1 or kernel in ("chunked", "fused"):
        # one piece's logits at a time (fp32 scores, softmax, gradient), and the gradients the
        # forward made: the head input's (fp32 under autocast) and the weight's (fp32)
        per_logit = CUDA_CHUNK_PER_LOGIT if device_type == "cuda" else HEAD_ACT_PER_V * 4
        head = per_logit * V * -(-positions // chunks) + 4 * C * positions + 4 * V * C
    else:
        head = head_per_logit * V * positions
    return int(blocks + head)
