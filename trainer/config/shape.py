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


def parameter_count(m) -> int:
    """The model's parameters (a tied embedding once), counted from the shape of the model section
    alone, as trainer/model builds them: what the size checks read before any model exists (a test
    keeps it equal to the built model's count for every preset)."""
    C, kv = m.n_embd, (m.n_kv_head or m.n_head) * (m.n_embd // m.n_head)
    vocab = (m.vocab_size + m.pad_vocab_multiple - 1) // m.pad_vocab_multiple * m.pad_vocab_multiple
    hidden = mlp_width(C, m.mlp, m.mlp_hidden, m.mlp_multiple_of)
    fc_out = 2 * hidden if m.mlp == "swiglu" else hidden
    norm = C * (2 if m.norm == "layernorm" and m.bias else 1)  # RMSNorm and LayerNorm(bias=False): a weight
    linear_bias = (C + 2 * kv) + C + fc_out + C if m.bias else 0  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    qk_norm = 2 * (m.n_embd // m.n_head) if m.qk_norm else 0
    block = 2 * norm + C * (C + 2 * kv) + C * C + C * fc_out + hidden * C + linear_bias + qk_norm
    positions = m.block_size * C if m.pos == "learned" else 0  # RoPE has no table
    head = 0 if m.tie_embeddings else vocab * C
    return vocab * C + positions + m.n_layer * block + norm + head
