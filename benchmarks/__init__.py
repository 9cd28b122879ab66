"""Benchmarks of the staged engines and their baselines: ``python -m benchmarks <name>``.

Speed is measured here and never asserted in tests (the rules are in benchmarks/README.md):
warm up, several runs, medians, engines compared as per-run ratios measured in the same run, and every
raw figure written to ``benchmarks/results/<name>-<device>.json`` next to a matplotlib plot.
"""
