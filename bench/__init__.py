"""Benchmarks: programs that print ratios against baselines measured in the same run.

``python -m bench`` runs the farm benchmark (:mod:`bench.farm`); ``python -m
bench.engine`` the bare engine alone.
"""
