"""What a run is: the typed schema, batch arithmetic, trajectory and operational keys, ranges,
the tokenizer's size, and every Hydra entry point (compose.py). Torch-free as a whole package: a
user's mistake in a key is reported before torch would load.
"""
