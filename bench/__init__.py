"""Benchmarks of specgate against its goals and its peers; method, commands and results in BENCHMARKS.md."""
