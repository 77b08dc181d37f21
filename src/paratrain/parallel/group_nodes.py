"""How a group's ranks sit on nodes, which the collective costs (costs/collectives.py: `rails`) need."""

from __future__ import annotations

import math

from paratrain.parallel.layout import DIM_NAMES, GROUP_DIMS


def members_per_node(layout, group: str, gpus_per_node: int) -> int:
    """How many ranks of `group` share one node (ranks fill nodes in mesh order, tp innermost)."""
    inner = DIM_NAMES.index(GROUP_DIMS[group][-1]) + 1
    stride = math.prod(getattr(layout, d) for d in DIM_NAMES[inner:])
    return max(1, min(layout.group_size(group), gpus_per_node // stride))
