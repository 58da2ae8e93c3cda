"""The model's shape, each block option a field (model.* in the run's config). The fields are the
schema's own (trainer/config/schema.py ModelConfig: the tiny model with GPT-2's block): their names,
order and defaults are read from there, never restated, so the model a config section builds and the
one GPTConfig() builds cannot drift apart, and a block option added to the schema is a field here."""

from __future__ import annotations

import dataclasses

from trainer.config.schema import ModelConfig, MoEConfig
from trainer.config.shape import mlp_width
from trainer.config.vocab import TOKENIZER_VOCAB_SIZE

# ModelConfig's keys that say which preset a run names, where its first weights come from and which
# kernel computes attention (the same weights under each: set on the layers by
# trainer/model/layers.py use_attention), not what shape the model has.
NOT_SHAPE = ("name", "init_from", "attention")
# The schema's default vocab_size is the tokenizer's, read when the config resolves: GPT-2's here.
RESOLVED_DEFAULTS = {"vocab_size": TOKENIZER_VOCAB_SIZE}



def _field_default(f: dataclasses.Field):
    if f.default is dataclasses.MISSING:  # a nested group (model.moe): its own default instance
        return dataclasses.field(default_factory=f.default_factory)
    return RESOLVED_DEFAULTS.get(f.name, f.default)


_ShapeFields = dataclasses.make_dataclass(
    "_ShapeFields",
    [(f.name, f.type, _field_default(f)) for f in dataclasses.fields(ModelConfig) if f.name not in NOT_SHAPE],
    frozen=True,
)


@dataclasses.dataclass(frozen=True)
class GPTConfig(_ShapeFields):
    """ModelConfig's fields less NOT_SHAPE, in its order (what each means is written there), and
    what the model derives from them."""

    def __post_init__(self):
        # model.moe arrives as the run config's mapping, or as a tuple of its values
        # (dataclasses.astuple, the memory plan's cache key): held as a MoEConfig either way.
        moe = self.moe
        if isinstance(moe, tuple):
            moe = MoEConfig(*moe)
        elif not isinstance(moe, MoEConfig):
            moe = MoEConfig(**{f.name: moe[f.name] for f in dataclasses.fields(MoEConfig) if f.name in moe})
        object.__setattr__(self, "moe", moe)
        # model.head_dim null: n_embd / n_head (every model before the key existed)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def q_width(self) -> int:
        """The queries' width (and attention's output's): n_head x head_dim, n_embd unless
        model.head_dim sets the heads apart from the model width."""
        return self.n_head * self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def hidden(self) -> int:
        """The MLP's hidden width (see trainer.config.shape.mlp_width)."""
        return mlp_width(self.n_embd, self.mlp, self.mlp_hidden, self.mlp_multiple_of)

    @property
    def expert_hidden(self) -> int:
        """Each MoE expert's SwiGLU width: model.moe.expert_hidden, or the dense width / top_k."""
        return self.moe.expert_hidden or max(1, self.hidden // self.moe.top_k)

    def summary(self) -> str:
        """The block's options in a few words (GPT-2's: "layernorm, learned, gelu 3072")."""
        parts = [self.norm, self.pos, f"{self.mlp} {self.hidden}"]
        moe = self.moe
        if moe.num_experts > 0:
            shared = f" + {moe.num_shared_experts} shared" if moe.num_shared_experts else ""
            every = f" every {moe.every} layers" if moe.every > 1 else ""
            parts.append(f"moe {moe.top_k} of {moe.num_experts} x {self.expert_hidden}{shared}{every}")
        if self.kv_heads != self.n_head:
            parts.append(f"{self.n_head} q / {self.kv_heads} kv heads")
        if self.q_width != self.n_embd:
            parts.append(f"heads {self.head_dim} wide")
        flags = (("qk-norm", self.qk_norm), ("untied head", not self.tie_embeddings), ("no bias", not self.bias))
        parts += [word for word, on in flags if on]
        return ", ".join(parts)

    @classmethod
    def from_cfg(cls, model_cfg) -> GPTConfig:
        """From the run's model config. A key the saved config of an older run lacks keeps its
        default (the schema's: GPT-2's block), so old checkpoints build the model they were trained
        with."""
        return cls(**{f.name: model_cfg[f.name] for f in dataclasses.fields(cls) if f.name in model_cfg})
