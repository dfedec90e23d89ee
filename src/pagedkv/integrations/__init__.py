"""Drop-in adapters that put existing engines on pagedkv's allocator.

Each module speaks one engine's own block-manager interface and imports nothing of that engine:
the engine passes its objects in, the adapter reads and writes the attributes the engine's own
manager does. ``pagedkv.integrations.nanovllm``: nano-vllm's ``BlockManager``.
"""
