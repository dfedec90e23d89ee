"""pagedkv: the block allocator behind a paged KV cache.

The core (``KVCacheManager`` and the ``BlockPool`` beneath it) needs only numpy. Everything that
measures the design (store, model, simulator, report) sits on top and imports only the public API.
"""
from .types import (AllBlocksCleared, BlockRemoved, BlockStored, CopyOp, OutOfBlocks, PrefixHit,
                    Transfer, Usage)
from .kv_specs import ChunkedLocalAttention, FullAttention, RecurrentState, SlidingWindow
from .pool import BlockPool
from .manager import KVCacheManager

__all__ = [
    "KVCacheManager",
    "BlockPool",
    "OutOfBlocks",
    "CopyOp",
    "Transfer",
    "PrefixHit",
    "Usage",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "FullAttention",
    "SlidingWindow",
    "ChunkedLocalAttention",
    "RecurrentState",
]
__version__ = "0.1.0"
