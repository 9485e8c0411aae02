"""``inspect``: the summary, the streamed listing in table, JSON and Parquet."""

from __future__ import annotations

import io
import json
import pathlib
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hicache.codec import HEADER_SIZE
from hicache.errors import BadMagicError, InvalidArgumentError
from hicache.tools.store.inspect import InspectOptions, OutputFormat, inspect_store

if TYPE_CHECKING:
    from store_kit import StoreKit


async def fill(kit: StoreKit) -> list[list[str]]:
    """Two tenants, two pools, one compressed chain, two damaged headers."""
    chains = [
        await kit.chain(4, tenant="alice"),
        await kit.chain(3, tenant="bob"),
        await kit.chain(2, tenant="alice", pool="indexer"),
        await kit.chain(5, tenant="bob", compress=True, payload_bytes=4096),
    ]
    await kit.truncate(chains[0][3], HEADER_SIZE + 10)
    await kit.replace("plugin-object", b"x" * 300)  # no hicache header, key of another shape
    return chains


async def test_summary(kit: StoreKit) -> None:
    chains = await fill(kit)
    out = io.StringIO()
    summary = await inspect_store(kit.backend, InspectOptions(fmt=OutputFormat.JSON), out)
    data = json.loads(out.getvalue())
    assert data == json.loads(json.dumps(summary.to_json()))
    sizes = {k: len(await kit.read(k)) for chain in chains for k in chain}
    assert data["objects"] == 15 and data["bytes"] == sum(sizes.values()) + 300
    alice, bob = chains[0][0][:16], chains[1][0][:16]
    assert chains[2][0][:16] == alice and chains[3][0][:16] == bob
    assert {k: v["objects"] for k, v in data["namespaces"].items()} == {
        alice: 6,
        bob: 8,
        "other": 1,
    }
    # The truncated page's header is intact, so it still counts under its pool and codec.
    assert {k: v["objects"] for k, v in data["pools"].items()} == {"kv": 12, "indexer": 2}
    assert {k: v["objects"] for k, v in data["codecs"].items()} == {"none": 9, "zstd_planes": 5}
    assert {k: v["objects"] for k, v in data["status"].items()} == {
        "ok": 13,
        "truncated": 1,
        "foreign": 1,
    }
    assert data["compression_ratio"] > 1.5
    assert data["oldest"] <= data["newest"]


async def test_table_summary(kit: StoreKit) -> None:
    await fill(kit)
    out = io.StringIO()
    await inspect_store(kit.backend, InspectOptions(), out)
    text = out.getvalue()
    assert text.startswith("objects      15\n")
    assert "zstd_planes" in text and "indexer" in text and "truncated" in text


async def test_json_listing_is_one_array_of_rows(kit: StoreKit) -> None:
    chains = await fill(kit)
    out = io.StringIO()
    await inspect_store(kit.backend, InspectOptions(True, OutputFormat.JSON), out)
    rows = json.loads(out.getvalue())
    by_key = {row["key"]: row for row in rows}
    assert len(rows) == len(by_key) == 15
    for chain in chains:
        for index, key in enumerate(chain):
            row = by_key[key]
            assert row["page_index"] == index and row["namespace"] == key[:16]
            assert row["format"] == key[17:33] and row["bytes"] == len(await kit.read(key))
    assert by_key[chains[3][0]]["codec"] == "zstd_planes"
    assert by_key[chains[0][3]]["status"] == "truncated"
    other = by_key["plugin-object"]
    assert (other["namespace"], other["pool"], other["page_index"], other["status"]) == (
        None,
        None,
        None,
        "foreign",
    )


async def test_table_listing(kit: StoreKit) -> None:
    chains = await fill(kit)
    out = io.StringIO()
    await inspect_store(kit.backend, InspectOptions(list_objects=True), out)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == [
        "key",
        "namespace",
        "pool",
        "index",
        "bytes",
        "codec",
        "mtime",
        "(UTC)",
        "status",
    ]
    assert len(lines) == 16
    assert any(line.startswith(chains[2][1]) and " indexer " in line for line in lines)


async def test_parquet(kit: StoreKit, tmp_path: pathlib.Path) -> None:
    chains = await fill(kit)
    target = tmp_path / "catalog.parquet"
    out = io.StringIO()
    options = InspectOptions(fmt=OutputFormat.PARQUET, output=str(target))
    await inspect_store(kit.backend, options, out)
    table = pq.read_table(target)
    assert table.schema.field("mtime").type == pa.timestamp("us", tz="UTC")
    assert table.schema.field("page_index").type == pa.uint32()
    assert not table.schema.field("key").nullable
    rows = {row["key"]: row for row in table.to_pylist()}
    assert len(rows) == 15
    assert rows[chains[1][2]]["page_index"] == 2
    assert rows["plugin-object"]["pool"] is None
    assert out.getvalue().startswith("objects      15")  # the summary goes to the stream


async def test_parquet_needs_an_output_file(memory_kit: StoreKit) -> None:
    with pytest.raises(InvalidArgumentError, match="--output"):
        await inspect_store(
            memory_kit.backend, InspectOptions(fmt=OutputFormat.PARQUET), io.StringIO()
        )


async def test_prefix_lists_one_namespace(kit: StoreKit) -> None:
    chains = await fill(kit)
    out = io.StringIO()
    options = InspectOptions(True, OutputFormat.JSON, prefix=chains[0][0][:16])
    await inspect_store(kit.backend, options, out)
    assert {row["key"] for row in json.loads(out.getvalue())} == {*chains[0], *chains[2]}


async def test_empty_store_lists_nothing(kit: StoreKit, tmp_path: pathlib.Path) -> None:
    target = tmp_path / "rows.json"
    options = InspectOptions(True, OutputFormat.JSON, output=str(target))
    summary = await inspect_store(kit.backend, options, io.StringIO())
    assert summary.total.objects == 0 and json.loads(target.read_text()) == []


async def test_not_a_store_writes_no_file(kit: StoreKit, tmp_path: pathlib.Path) -> None:
    for i in range(3):
        await kit.replace(f"foreign-{i}", b"\x00" * 500)
    for fmt in (OutputFormat.JSON, OutputFormat.PARQUET):
        target = tmp_path / f"rows.{fmt.value}"
        with pytest.raises(BadMagicError):
            await inspect_store(kit.backend, InspectOptions(True, fmt, str(target)), io.StringIO())
        assert not target.exists()
