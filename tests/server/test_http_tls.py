"""HTTPS: a server given a certificate and key answers TLS only (with a certificate the test
makes), and files that do not load are a ConfigError before it listens."""

from __future__ import annotations

import asyncio
import pathlib
import ssl

import httpx
import pytest
from serving_kit import ENGINE, tiny_model
from tls_kit import self_signed

from hicache.errors import ConfigError
from hicache.models.config import ModelPreset
from hicache.server.app import HttpServer, Listen, TlsFiles
from hicache.server.request_body import ServedModel
from hicache.serving.engine import CacheMode
from hicache.serving.setup import open_engine

x509 = pytest.importorskip("cryptography.x509")


async def test_the_server_answers_https_with_its_certificate(tmp_path: pathlib.Path) -> None:
    tls = self_signed(tmp_path)
    setup = await open_engine(tiny_model(ModelPreset.DENSE), CacheMode.DEVICE, None, 128, ENGINE)
    server = HttpServer(setup, ServedModel("tiny", 1000), Listen("127.0.0.1", 0, 5.0, tls))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.url is not None or task.done():
                break
            await asyncio.sleep(0.01)
        assert server.url is not None and server.url.startswith("https://")
        trust = ssl.create_default_context(cafile=tls.certfile)
        async with httpx.AsyncClient(verify=trust) as client:
            answer = await client.get(f"{server.url}/health")
            assert answer.status_code == 200
            body = {"prompt": [1, 2, 3], "max_tokens": 2}
            done = await client.post(f"{server.url}/v1/completions", json=body)
            assert done.status_code == 200 and len(done.json()["choices"][0]["token_ids"]) == 2
        plain = server.url.replace("https://", "http://")
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.HTTPError):  # no plain HTTP on a TLS port
                await client.get(f"{plain}/health")
    finally:
        server.stop()
        await asyncio.wait_for(task, 30)


def test_files_that_do_not_load_are_a_config_error(tmp_path: pathlib.Path) -> None:
    tls = self_signed(tmp_path)
    for bad in (
        TlsFiles(tls.certfile, str(tmp_path / "none.pem")),
        TlsFiles(tls.keyfile, tls.keyfile),
    ):
        with pytest.raises(ConfigError, match="TLS files"):
            bad.context()
