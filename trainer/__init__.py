"""dtrain: one train/eval loop for GPT-2-style models under single, DP, DDP, ZeRO and FSDP."""

__version__ = "0.1.0"
