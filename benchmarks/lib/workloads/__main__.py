"""python -m benchmarks.lib.workloads: write the workload files again from their seeded recipes."""

from . import NAMES, load, summary, write

write()
for name in NAMES:
    print(name, summary(load(name)))
