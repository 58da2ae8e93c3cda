"""Data preparation: tokenizer, sources, tokenize-and-shard, shard access."""
