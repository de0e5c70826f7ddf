"""Selection: the cache holds every token; each decode step reads only some blocks of it.

Torch only (like :mod:`reasonkv.policies`): the pooled side cache (:mod:`~reasonkv.selection.pooled`), the
block choice and the slots it reads (:mod:`~reasonkv.selection.blocks`), Quest's bound
(:mod:`~reasonkv.selection.quest`), SeerAttention-R's gate (:mod:`~reasonkv.selection.gate`), its file
(:mod:`~reasonkv.selection.gatefile`) and training loss (:mod:`~reasonkv.selection.distill`), and the
per-cache :class:`~reasonkv.selection.reader.Selector` the attention kernel wrapper calls.
"""

from reasonkv.selection.blocks import BlockChoice, blocks_per_step, choose_blocks, gather_slots, read_slots
from reasonkv.selection.pooled import PooledKeys, pool_keys
from reasonkv.selection.quest import quest_scores
from reasonkv.selection.reader import Selector

__all__ = [
    "BlockChoice",
    "PooledKeys",
    "Selector",
    "blocks_per_step",
    "choose_blocks",
    "gather_slots",
    "pool_keys",
    "quest_scores",
    "read_slots",
]
