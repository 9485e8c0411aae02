"""What every engine's tests share: one real ``redis-server`` for the session, for the test each
engine runs over ``redis://`` (issue 47). Started on a free 127.0.0.1 port, stopped by pid.
Each engine's conftest imports the two fixtures. Not a conftest in ``tests/integrations``:
pytest would put that folder on ``sys.path``, where its ``lmcache`` and ``sglang`` folders
pass for the engines themselves.

Skipped, with the reason, where ``redis-server`` or redis-py is missing (an engine venv built
from an older requirements list, a machine without the Debian package).
"""

from __future__ import annotations

import importlib.util
import itertools
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from hicache.tools.services.redis import RedisServer

_PREFIXES = itertools.count()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    if importlib.util.find_spec("redis") is None:
        pytest.skip("redis-py is not installed in this venv (the redis extra)")
    from hicache.tools.services.redis import RedisServer

    with RedisServer(str(tmp_path_factory.mktemp("redis"))) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A ``redis://`` URL with a key prefix no other test uses (the server outlives tests)."""
    return redis_server.url(key_prefix=f"engine-test-{next(_PREFIXES)}/")
