"""The model's shape, each block option a field (model.* in the run's config). Every default is the
schema's (trainer/config/schema.py ModelConfig: the tiny model with GPT-2's block), taken from there, so
the model a config section builds and the one GPTConfig() builds cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.schema import ModelConfig as Schema
from trainer.config.shape import mlp_width
from trainer.config.vocab import TOKENIZER_VOCAB_SIZE


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = Schema.n_layer
    n_head: int = Schema.n_head
    n_embd: int = Schema.n_embd
    block_size: int = Schema.block_size
    # the schema's default is the tokenizer's size, read when the config resolves: GPT-2's here
    vocab_size: int = TOKENIZER_VOCAB_SIZE
    pad_vocab_multiple: int = Schema.pad_vocab_multiple
    dropout: float = Schema.dropout
    bias: bool = Schema.bias
    norm: str = Schema.norm
    norm_eps: float = Schema.norm_eps
    pos: str = Schema.pos
    rope_theta: float = Schema.rope_theta
    mlp: str = Schema.mlp
    mlp_hidden: int | None = Schema.mlp_hidden
    mlp_multiple_of: int = Schema.mlp_multiple_of
    n_kv_head: int | None = Schema.n_kv_head
    qk_norm: bool = Schema.qk_norm
    tie_embeddings: bool = Schema.tie_embeddings

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def hidden(self) -> int:
        """The MLP's hidden width (see trainer.config.shape.mlp_width)."""
        return mlp_width(self.n_embd, self.mlp, self.mlp_hidden, self.mlp_multiple_of)

    def summary(self) -> str:
        """The block's options in a few words (GPT-2's: "layernorm, learned, gelu 3072")."""
        parts = [self.norm, self.pos, f"{self.mlp} {self.hidden}"]
        if self.kv_heads != self.n_head:
            parts.append(f"{self.n_head} q / {self.kv_heads} kv heads")
        flags = (("qk-norm", self.qk_norm), ("untied head", not self.tie_embeddings), ("no bias", not self.bias))
        parts += [word for word, on in flags if on]
        return ", ".join(parts)

    @classmethod
    def from_cfg(cls, model_cfg) -> GPTConfig:
        """From the run's model config. A key the saved config of an older run lacks keeps its
        default (the schema's: GPT-2's block), so old checkpoints build the model they were trained
        with."""
        return cls(**{k: model_cfg[k] for k in cls.__dataclass_fields__ if k in model_cfg})
