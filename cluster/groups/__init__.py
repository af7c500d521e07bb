"""Worker groups (issue 17): K rank actors on K distinct `mlx` nodes forming one `mx.distributed` ring and holding
one model split across them; to the scheduler a group is one worker (notes/GROUPS.md)."""

from .form import Formed, form, group_count, launch, names, rank_row, ready, ready_groups, release
from .pool import GroupHandle, GroupPool, ring_failure
from .rank import GroupRank

__all__ = ["Formed", "GroupHandle", "GroupPool", "GroupRank", "form", "group_count", "launch", "names", "rank_row", "ready", "ready_groups", "release", "ring_failure"]
