"""Benchmark workers and measurements behind scripts/bench.py, bench_checkpoint.py and
bench_hellaswag.py: they time the product's own code and live outside the product package.

The scripts put scripts/ first on sys.path and import this package as `benchmarks`; from the
repository root (the tests) it is `scripts.benchmarks`. Its modules import each other relatively,
so both names work. Worker entry points are module-level functions: torchrun's engine pickles them
by name into fresh processes, which inherit the parent's sys.path.
"""
