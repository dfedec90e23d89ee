"""The public request traces pagedkv replays, shipped inside the package (gzip-compressed).

Read them through :func:`pagedkv.sim.traces.trace_path` (by short name: ``"azure-conv"``,
``"azure-code"``, ``"mooncake"``), which finds them with ``importlib.resources`` wherever the
package is installed. ``README.md`` here says where each file comes from, what its fields mean
and how Mooncake ``hash_ids`` become tokens; ``NOTICE.md`` carries the attribution and licence
terms the files are distributed under.
"""
