"""What both tiers read: the config, the policies, the metrics and the parts' narrow views
(``parts.py``: :class:`~hicache.tiering.common.parts.TierPools`, the Protocols, the device <->
host copy handle). ``host/`` and ``l3/`` import these and the cache above them builds both, so
they sit in a folder of their own below the tiers: at ``tiering/`` itself, beside the cache,
they would make the tiers and their parent import each other.
"""
