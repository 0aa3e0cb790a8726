"""Helpers of ``benchmarks/benchmark_accuracy.py``: data, HF reference, paths, rules, report."""
