"""``python -m bench``: the benchmark harness (bench/harness.py)."""

from bench.harness import main

main()
