"""A model's size from its config section alone, without torch: the MLP's width and the parameter
count, as trainer/model builds them (the size checks, `dtrain plan` and the Hugging Face mappings
read them before any model exists; a test keeps the count equal to the built model's)."""

from __future__ import annotations


def mlp_width(n_embd: int, mlp: str, mlp_hidden: int | None, multiple_of: int) -> int:
    """The MLP's hidden width: model.mlp_hidden, else 4 x n_embd, or for SwiGLU Llama's rule (two
    thirds of 4 x n_embd, which keeps its three matrices at the two matrices' parameter count,
    rounded up to a multiple of `multiple_of`)."""
    if mlp_hidden is not None:
        return mlp_hidden
    if mlp != "swiglu":
        return 4 * n_embd
    hidden = int(2 * 4 * n_embd / 3)
    return (hidden + multiple_of - 1) // multiple_of * multiple_of


def head_width(m) -> int:
    """Each attention head's width: model.head_dim, or n_embd / n_head when it is null (or absent:
    a config saved before the key existed)."""
    return m.get("head_dim") or m.n_embd // m.n_head


def moe_layer_count(m) -> int:
    """How many blocks carry model.moe's experts in place of the dense MLP (layer i when (i + 1) is
    a multiple of model.moe.every: trainer/model/moe.py is_moe_layer)."""
    moe = m.get("moe")
    return m.n_layer // moe.every if moe is not None and moe.num_experts > 0 else 0


def _moe_block_mlp(m, C: int) -> int:
    """One MoE layer's feed-forward parameters: the router, the routed experts' SwiGLU matrices and
    the shared experts' (no biases: Qwen3-MoE's)."""
    moe = m.moe
    hidden = moe.expert_hidden or max(1, mlp_width(C, m.mlp, m.mlp_hidden, m.mlp_multiple_of) // moe.top_k)
    return moe.num_experts * C + (moe.num_experts + moe.num_shared_experts) * 3 * hidden * C


def parameter_count(m) -> int:
    """The model's parameters (a tied embedding once), counted from the shape of the model section
    alone, as trainer/model builds them: what the size checks read before any model exists (a test
    keeps it equal to the built model's count for every preset)."""
    C, head = m.n_embd, head_width(m)
    q, kv = m.n_head * head, (m.n_kv_head or m.n_head) * head
    vocab = (m.vocab_size + m.pad_vocab_multiple - 1) // m.pad_vocab_multiple * m.pad_vocab_multiple
    hidden = mlp_width(C, m.mlp, m.mlp_hidden, m.mlp_multiple_of)
    fc_out = 2 * hidden if m.mlp == "swiglu" else hidden
    norm = C * (2 if m.norm == "layernorm" and m.bias else 1)  # RMSNorm and LayerNorm(bias=False): a weight
    attn = C * (q + 2 * kv) + q * C + ((q + 2 * kv) + C if m.bias else 0)  # c_attn, c_proj
    dense_mlp = C * fc_out + hidden * C + (fc_out + C if m.bias else 0)  # c_fc, mlp.c_proj
    qk_norm = 2 * head if m.qk_norm else 0
    moe_layers = moe_layer_count(m)
    blocks = m.n_layer * (2 * norm + attn + qk_norm) + (m.n_layer - moe_layers) * dense_mlp
    blocks += moe_layers * _moe_block_mlp(m, C) if moe_layers else 0
    positions = m.block_size * C if m.pos == "learned" else 0  # RoPE has no table
    head_weight = 0 if m.tie_embeddings else vocab * C
    return vocab * C + positions + blocks + norm + head_weight
