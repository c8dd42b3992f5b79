"""``splitserve bench``: offline throughput against transformers and online serving latency, measured side by side.

``workload`` builds the seeded checkpoint and request set both benchmarks share and counts model FLOPs;
``throughput`` and ``serve`` run the backends and write JSON and PNG results under ``benchmarks/results/``.
"""
