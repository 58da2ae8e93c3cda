"""Fetching from the network: URL and PyPI-sdist downloads, whether the Hugging Face Hub answers."""
