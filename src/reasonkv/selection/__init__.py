"""Selection: the cache holds every token; each decode step reads only some blocks of it.

What the selection policies (quest, seer) share, torch only: the pooled side cache, the block choice and the
slots it reads, and the per-cache :class:`~reasonkv.selection.reader.Selector` the kernel reader calls.
"""

from reasonkv.selection.blocks import BlockChoice, blocks_per_step, choose_blocks, gather_slots, read_slots
from reasonkv.selection.pooled import PooledKeys, pool_keys
from reasonkv.selection.reader import Selector

__all__ = [
    "BlockChoice",
    "PooledKeys",
    "Selector",
    "blocks_per_step",
    "choose_blocks",
    "gather_slots",
    "pool_keys",
    "read_slots",
]
