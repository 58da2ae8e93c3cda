"""The model's shape: GPT-2's by default, each block option a field (model.* in the run's config)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.shape import mlp_width


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 50257
    pad_vocab_multiple: int = 1
    dropout: float = 0.0
    bias: bool = True
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    pos: str = "learned"
    rope_theta: float = 10000.0
    mlp: str = "gelu"
    mlp_hidden: int | None = None
    mlp_multiple_of: int = 256
    n_kv_head: int | None = None
    qk_norm: bool = False
    tie_embeddings: bool = True

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
        default (GPT-2's), so old checkpoints build the model they were trained with."""
        return cls(**{k: model_cfg[k] for k in cls.__dataclass_fields__ if k in model_cfg})
