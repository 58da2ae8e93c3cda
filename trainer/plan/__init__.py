"""The memory plan: per-rank bytes of every mode and the largest micro batch that fits (`dtrain plan`)."""
