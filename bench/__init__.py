"""``python -m bench``: mtask's benchmark suite: throughput and latency on a real server.

Every throughput figure is also printed as a ratio to W0, the same server doing the minimum a
claim + completion cycle needs with raw PyMongo, measured in the same run: the machine is noisy,
so only ratios within one run compare. Results go to a table and to ``bench/results.md``.
Benchmarks measure; no test asserts a wall-clock figure (``--quick`` runs in CI so the suite
never rots).
"""
