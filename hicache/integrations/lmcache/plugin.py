"""LMCache remote-storage plugin: LMCache chunks stored in any hicache backend.

LMCache (0.5.6) loads it from its own config::

    remote_storage_plugins: ["hicache"]
    extra_config:
      remote_storage_plugin.hicache.module_path: hicache.integrations.lmcache
      remote_storage_plugin.hicache.class_name: LMCacheConnectorAdapter
      remote_storage_plugin.hicache.url: file:///var/cache/hicache

The URL is any hicache backend URL (``file://``, ``memory://``, ``mooncake://``, ``s3://``
through fsspec, ...). A second instance ``hicache.<name>`` in ``remote_storage_plugins`` reads
its own ``remote_storage_plugin.hicache.<name>.url``.

A configuration that cannot work (no URL, a URL no backend takes, a serde or mode the page
format does not cover) raises :class:`LMCacheConfigError` when LMCache builds the connector;
a backend that cannot be reached raises its own error and LMCache retries later.
"""

from __future__ import annotations

import asyncio
from typing import Any

from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)

from hicache.backends.base import StorageBackend
from hicache.backends.registry import default_registry
from hicache.errors import HiCacheError
from hicache.integrations.lmcache.connector import (
    HiCacheConnector,
    LMCacheConfigError,
    run_on_loop,
)

__all__ = ["PLUGIN_TYPE", "HiCacheConnector", "LMCacheConfigError", "LMCacheConnectorAdapter"]

PLUGIN_TYPE = "hicache"
_PLUGIN_SCHEME = "plugin://"
# Opening may connect to a remote store (Mooncake, S3): longer than one get may take.
_OPEN_TIMEOUT_S = 60.0


class LMCacheConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]  # LMCache ships no types
    """Builds a :class:`HiCacheConnector` for LMCache's ``plugin://hicache[.<name>]`` URLs."""

    def __init__(self) -> None:
        super().__init__(_PLUGIN_SCHEME + PLUGIN_TYPE)

    def can_parse(self, url: str) -> bool:
        # Not a prefix test: "plugin://hicachex" names another plugin.
        if not url.startswith(_PLUGIN_SCHEME):
            return False
        return bool(extract_plugin_type(url[len(_PLUGIN_SCHEME) :]) == PLUGIN_TYPE)

    def create_connector(self, context: ConnectorContext) -> HiCacheConnector:
        config, metadata = context.config, context.metadata
        plugin = context.plugin_name or PLUGIN_TYPE
        url = _check_config(config, metadata, plugin)
        backend = _open_backend(context.loop, url, plugin)
        try:
            return HiCacheConnector(
                context.loop, context.local_cpu_backend, config, metadata, backend
            )
        except BaseException:
            run_on_loop(context.loop, backend.close(), _OPEN_TIMEOUT_S)
            raise


def _check_config(config: Any, metadata: Any, plugin: str) -> str:
    """The backend URL of plugin instance ``plugin``, once the LMCache config can work."""
    if config is None or metadata is None:
        raise LMCacheConfigError("the hicache connector needs LMCache's config and metadata")
    option = f"remote_storage_plugin.{plugin}.url"
    url = (config.extra_config or {}).get(option)
    if not isinstance(url, str) or not url:
        raise LMCacheConfigError(f"set extra_config {option} to a hicache backend URL")
    # Pages hold raw KV with its dtype and shape; another serde's output has neither.
    if config.remote_serde != "naive":
        raise LMCacheConfigError(
            f"the hicache connector stores raw KV: remote_serde must be 'naive', "
            f"not {config.remote_serde!r}"
        )
    # LMCache's remote connectors size reads by the full chunk (RemoteConnector.__init__
    # notes layerwise as a TODO); per-layer objects would all read as misses.
    if config.use_layerwise:
        raise LMCacheConfigError("the hicache connector does not support use_layerwise")
    return url


def _open_backend(loop: asyncio.AbstractEventLoop, url: str, plugin: str) -> StorageBackend:
    """The backend for ``url``, opened on ``loop``: its locks and tasks belong to that loop."""
    option = f"remote_storage_plugin.{plugin}.url"
    try:
        # Resolved here, not on the loop: a bad URL fails now, with a message naming it.
        cls, backend_url = default_registry.resolve_url(url)
        backend_config = cls.config_from_url(backend_url, {})
    except HiCacheError as exc:
        raise LMCacheConfigError(f"{option} = {url!r}: {exc}") from exc
    return run_on_loop(loop, cls.open(backend_config), _OPEN_TIMEOUT_S)
