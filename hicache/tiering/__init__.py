"""The tiered cache: the radix tree over device, host and L3, and the parts it is built from.

Here: :class:`~hicache.tiering.cache.HiRadixCache` and its controller, the two modules that
build and join both tiers, and :mod:`~hicache.tiering.contract`, what an engine may call on the
cache (and when). Below them, lowest first: ``common/`` (what both tiers read),
``host/`` (device <-> host) and ``l3/`` (host <-> storage, which imports ``host/``); no folder
imports one above it.
"""
