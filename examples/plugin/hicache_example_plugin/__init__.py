"""An example hicache plugin: two storage backends, registered by entry point only.

- :class:`ExampleBackend` (``example://label``): the smallest complete backend, a dict.
- :class:`ExampleSdkBackend` (``example-sdk://endpoint``): a backend over a blocking client
  library (:class:`BlockingKVClient`, a stand-in SDK), calling it from worker threads.

See the README next to this package for how to write, register and test a backend.
"""

from hicache_example_plugin.dict_backend import ExampleBackend, ExampleConfig
from hicache_example_plugin.sdk import BlockingKVClient
from hicache_example_plugin.sdk_backend import ExampleSdkBackend, ExampleSdkConfig

__all__ = [
    "BlockingKVClient",
    "ExampleBackend",
    "ExampleConfig",
    "ExampleSdkBackend",
    "ExampleSdkConfig",
]
