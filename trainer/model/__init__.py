"""The model: GPT-2's block by default, today's blocks (RoPE, RMSNorm, SwiGLU, grouped KV heads,
QK-norm, an untied head) by configuration. config: the shape; layers: the block's pieces; gpt: the
model assembled."""
