"""Helpers of benchmarks/compare_peers.py: peer installs, server processes, the report."""
