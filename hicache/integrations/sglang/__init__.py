"""hicache backends as SGLang's ``dynamic`` HiCache storage backend.

SGLang loads :class:`SGLangStorage` from this package (``"module_path":
"hicache.integrations.sglang", "class_name": "SGLangStorage"``). The adapter is
:mod:`.storage`, its page reads and writes :mod:`.page_io`, the host pools it is given
:mod:`.pools`, and which stored prefix a pool can restore :mod:`.hits`.

The exported names are loaded on first use: :mod:`.storage` needs SGLang installed, the other
modules of the package do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from hicache.integrations.sglang.storage import AdapterConfig, SGLangStorage, extra_config

__all__ = ["AdapterConfig", "SGLangStorage", "extra_config"]

__getattr__ = lazy_getattr(__name__, dict.fromkeys(__all__, ".storage"))
