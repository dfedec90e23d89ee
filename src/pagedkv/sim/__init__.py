"""The simulator: serving runs, fleets and replays that drive the real allocator, never a model of it.

What it is for: measuring what paging costs and saves under real request traces. ``workloads``
and ``traces`` make requests; ``sizing`` turns model configs into KV bytes (and hybrid models'
attention groups); ``baselines`` (reservation allocators on ``buddy``, and ``ManagerAllocator``
over a real :class:`~pagedkv.KVCacheManager`), ``samples`` and ``tiered`` are the allocators;
``scheduler`` is the continuous-batching loop alone, with ``guards`` (its switches), ``records``
(its results), ``progress`` (a bar a caller may draw) and ``costmodel`` / ``metrics`` (modelled
time and what a run measured); ``fleet``, ``routers`` and ``dynamo_router`` run several
replicas behind a router; ``swap_cost``, ``page_layout``, ``cache_replay``, ``hybrid_hits`` and
``hybrid_serving`` are the measurements the report builds on.

What it may import: the allocator's public API (``pagedkv``, ``pagedkv.kv_specs``,
``pagedkv.checks``, ``pagedkv.types``) and ``pagedkv.events`` (the fleet's precise router reads
replicas' KV events on the wire); never ``report``, ``commands`` or ``cli`` above it, and no
allocator internals.
"""
