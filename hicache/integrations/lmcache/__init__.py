"""LMCache remote-storage plugin: LMCache chunks stored in any hicache backend.

LMCache loads :class:`LMCacheConnectorAdapter` from this package
(``remote_storage_plugin.hicache.module_path: hicache.integrations.lmcache``). The plugin is
:mod:`.plugin`, the connector it builds :mod:`.connector`, LMCache keys as storage names
:mod:`.names`, and a chunk's pages :mod:`.pages`.

The exported names are loaded on first use: :mod:`.plugin` and :mod:`.connector` need LMCache
installed, :mod:`.names` and :mod:`.pages` do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from hicache.integrations.lmcache.plugin import (
        PLUGIN_TYPE,
        HiCacheConnector,
        LMCacheConfigError,
        LMCacheConnectorAdapter,
    )

__all__ = ["PLUGIN_TYPE", "HiCacheConnector", "LMCacheConfigError", "LMCacheConnectorAdapter"]

__getattr__ = lazy_getattr(__name__, dict.fromkeys(__all__, ".plugin"))
