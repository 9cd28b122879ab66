"""What the benchmarks share: the harness (machine record, alternation, medians, JSON and plots), the
benchmark models, the workload files, the drivers of a workload on one engine and the serving load."""
