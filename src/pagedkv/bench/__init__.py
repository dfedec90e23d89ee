"""Benchmarks of pagedkv's hot paths (shipped with the package so that ``pagedkv bench`` runs anywhere).

``core`` holds the timed rows (one-group and two-group managers, the trace replay) and their
targets, ``harness`` the timing loop (medians, spread, calibration). What it may import: the
allocator's public API (``pagedkv``, ``pagedkv.kv_specs``) and numpy; never ``commands`` above it.
"""
