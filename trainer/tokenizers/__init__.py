"""The tokenizers: GPT-2's BPE offline, a Hugging Face tokenizer.json, one interface over both (the
`tokenizer` group), GPT-2's as Hugging Face's files."""
