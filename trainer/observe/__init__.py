"""What a run reports: metrics.jsonl and the console, trackers, provenance, peak FLOP/s, the
results tables and seed statistics.
"""
