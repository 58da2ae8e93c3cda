"""Hugging Face's model formats <-> ours: the one mapping `dtrain export` writes with and
`model.init_from` reads with (mapping.py: GPT-2's names and layouts, and the tensors of every family;
llama.py: Llama's and Qwen3's names and config.json)."""
