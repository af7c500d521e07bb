"""Worker groups (issue 17): K rank actors on K distinct `mlx` nodes forming one `mx.distributed` ring and holding
one model split across them; to the scheduler a group is one worker (notes/GROUPS.md); a lost group is re-formed
from fresh processes (reform)."""

from .form import Formed, form, group_count, launch, names, rank_row, ready, ready_groups, release, strategy
from .pool import GroupHandle, GroupPool, ring_failure
from .rank import GroupRank
from .reform import Recipe, Reform

__all__ = ["Formed", "GroupHandle", "GroupPool", "GroupRank", "Recipe", "Reform", "form", "group_count", "launch", "names", "rank_row", "ready", "ready_groups", "release", "ring_failure", "strategy"]
