"""Subcommands other than train and prepare (one module each)."""
