"""Storage tiers behind one small interface (:class:`Tier`)."""

from scd_store.store.tiers.base import LocalTier, Tier, TierError, TierUsage
from scd_store.store.tiers.cpu import CpuTier

__all__ = ["CpuTier", "LocalTier", "Tier", "TierError", "TierUsage"]
