"""Benchmarks of pagedkv's hot paths (shipped with the package so that ``pagedkv bench`` runs anywhere)."""
