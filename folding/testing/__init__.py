"""Multi-process test and tool helpers (long-lived gloo rank pools)."""

from .rank_pool import RankFailure, RankPool

__all__ = ["RankFailure", "RankPool"]
