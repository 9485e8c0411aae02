"""``hicache serve`` end to end with L3 on real services: S3 (a moto server) and Mooncake Store
(a real ``mooncake_master``). The cache must hit in L3 and never change what is generated."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from collections.abc import Iterator

import pytest

from hicache.tools.cli import main
from hicache.tools.services.moto import MotoServer

# A tiny model and a workload whose working set is larger than device and host together, so
# pages come back from L3 within one run.
TINY = [
    "--layers", "2", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
    "--vocab", "512", "--page-size", "4", "--clients", "10", "--rounds", "3",
    "--system-tokens", "32", "--turn-tokens", "16", "--output-tokens", "2",
    "--device-tokens", "128", "--host-pages", "48", "--prefetch-threshold", "8",
    "--max-running", "2", "--device", "cpu", "--json", "-q",
]  # fmt: skip


def serve(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:  # type: ignore[type-arg]
    code = main(["serve", *TINY, *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)  # type: ignore[no-any-return]


def by_name(result: dict) -> dict:  # type: ignore[type-arg]
    return {row["name"]: row for row in result["configs"]}


@pytest.fixture
def s3_url(moto_s3: MotoServer, tmp_path: pathlib.Path) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(
        key=moto_s3.access_key,
        secret=moto_s3.secret_key,
        client_kwargs={"endpoint_url": moto_s3.endpoint_url},
        skip_instance_cache=True,
    )
    bucket = f"serve-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    fs.mkdir(bucket)
    return (
        f"s3://{bucket}/kv?endpoint_url={moto_s3.endpoint_url}"
        f"&key={moto_s3.access_key}&secret={moto_s3.secret_key}"
    )


@pytest.mark.slow
def test_serve_with_s3_l3_hits_and_keeps_outputs(
    s3_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --l3-warm: both runs in the model's shared namespace, so the second reads the first's.
    result = serve(capsys, "--l3", s3_url, "--compare", "--l3-warm")
    rows = by_name(result)
    assert result["outputs_identical"] is True
    assert set(rows) == {"none", "device", "device+host", "device+host+l3"}
    l3 = rows["device+host+l3"]
    assert l3["bytes_host_to_l3"] > 0 and l3["errors"] == 0
    # A second process over the same bucket: what the first one wrote comes back from L3.
    again = serve(capsys, "--l3", s3_url, "--l3-warm", "--no-prefetch-skip")
    second = by_name(again)["device+host+l3"]
    # One configuration compares nothing: outputs_identical is None, not a vacuous True.
    assert second["hit_tokens_l3"] > 0 and again["outputs_identical"] is None


@pytest.fixture
def mooncake_url(tmp_path: pathlib.Path) -> Iterator[str]:
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not installed")
    from hicache.errors import BackendUnavailableError
    from hicache.tools.services.mooncake import MooncakeMaster, mooncake_master_path

    try:
        mooncake_master_path()
    except (BackendUnavailableError, OSError) as exc:
        pytest.skip(f"Mooncake: {exc}")
    master = MooncakeMaster(10_000, str(tmp_path / "master.log"))
    master.start()
    try:
        yield master.url(global_segment_bytes="64M", local_buffer_bytes="16M")
    finally:
        master.stop()


@pytest.mark.slow
def test_serve_with_mooncake_l3_hits_and_keeps_outputs(
    mooncake_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = serve(
        capsys, "--l3", mooncake_url, "--compare", "--prefetch-policy", "wait_complete",
        "--no-prefetch-skip",
    )  # fmt: skip
    rows = by_name(result)
    assert result["outputs_identical"] is True
    l3 = rows["device+host+l3"]
    assert l3["hit_tokens_l3"] > 0 and l3["errors"] == 0
    # Host pools, their header arena and the read-back check's scratch pages are registered:
    # every page moved without staging, the pages checked before a skipped write included.
    assert l3["bytes_host_to_l3"] > 0 and l3["bytes_staged"] == 0
    assert l3["pages_checked_l3"] > 0


@pytest.mark.slow
def test_serve_with_nixl_posix_l3_moves_pages_zero_copy(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not any(importlib.util.find_spec(name) for name in ("nixl_cu12", "nixl")):
        pytest.skip("NIXL is not installed (pip install 'hicache[nixl]')")
    result = serve(
        capsys,
        *("--l3", f"nixl://{tmp_path}/kv", "--compare", "--prefetch-policy", "wait_complete"),
        "--no-prefetch-skip",  # a tiny model computes faster than a file L3 reads
    )
    assert result["outputs_identical"] is True
    l3 = by_name(result)["device+host+l3"]
    assert l3["hit_tokens_l3"] > 0 and l3["errors"] == 0
    assert l3["bytes_host_to_l3"] > 0 and l3["bytes_staged"] == 0
    assert l3["pages_checked_l3"] > 0  # read back into registered scratch pages, not staged
