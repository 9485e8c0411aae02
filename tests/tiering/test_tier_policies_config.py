"""The pure policy rules, the HiCache config (files, flags, refusals) and an unreachable L3."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest
from tier_kit import PAGE, Harness

from hicache.errors import BackendError, ConfigError, InvalidArgumentError
from hicache.layouts import Layout
from hicache.tiering.common.config import (
    HiCacheConfig,
    PrefetchConfig,
    StorageConfig,
    TierConfig,
    check_config,
    config_from_mapping,
    load_config,
)
from hicache.tiering.common.policies import (
    L3Admission,
    PrefetchStopPolicy,
    TerminationReason,
    WritePolicy,
    admit_to_l3,
    backup_on_hit,
    can_terminate,
    prefetch_timeout,
)
from hicache.tools.config_flags import add_hicache_flags, config_from_args

DEFAULTS = PrefetchConfig()


# ----- pure rules ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "want"),
    [(0, 2.0), (1024, 2.1), (10_240, 3.0), (20_480, 4.0), (286_720, 30.0), (10**7, 30.0)],
)
def test_prefetch_timeout_formula_with_the_defaults(tokens: int, want: float) -> None:
    cfg = DEFAULTS
    assert (cfg.timeout_base_s, cfg.timeout_per_1k_tokens_s, cfg.timeout_max_s) == (2.0, 0.1, 30.0)
    got = prefetch_timeout(
        cfg.timeout_base_s, cfg.timeout_per_1k_tokens_s, cfg.timeout_max_s, tokens
    )
    assert got == pytest.approx(want)


def test_prefetch_timeout_refuses_negative_terms() -> None:
    with pytest.raises(InvalidArgumentError):
        prefetch_timeout(2.0, 0.1, 30.0, -1)
    with pytest.raises(InvalidArgumentError):
        prefetch_timeout(-1.0, 0.1, 30.0, 10)


@pytest.mark.parametrize("policy", list(PrefetchStopPolicy))
def test_a_finished_prefetch_is_complete_whatever_the_policy(policy: PrefetchStopPolicy) -> None:
    assert can_terminate(policy, True, 0.0, 5.0) is TerminationReason.COMPLETE


def test_can_terminate_per_policy_while_reads_run() -> None:
    best, wait = PrefetchStopPolicy.BEST_EFFORT, PrefetchStopPolicy.WAIT_COMPLETE
    timeout = PrefetchStopPolicy.TIMEOUT
    assert can_terminate(best, False, 0.0, 5.0) is TerminationReason.BEST_EFFORT
    assert can_terminate(wait, False, 10**6, 5.0) is None  # never gives up on its own
    assert can_terminate(timeout, False, 4.99, 5.0) is None
    assert can_terminate(timeout, False, 5.0, 5.0) is TerminationReason.TIMEOUT


def test_write_and_admission_rules() -> None:
    assert backup_on_hit(WritePolicy.WRITE_THROUGH, 0, 5)
    assert not backup_on_hit(WritePolicy.WRITE_THROUGH_SELECTIVE, 1, 2)
    assert backup_on_hit(WritePolicy.WRITE_THROUGH_SELECTIVE, 2, 2)
    assert not backup_on_hit(WritePolicy.WRITE_BACK, 100, 1)
    assert admit_to_l3(L3Admission.ALL, 0, 9)
    assert not admit_to_l3(L3Admission.HIT_THRESHOLD, 1, 2)
    assert admit_to_l3(L3Admission.HIT_THRESHOLD, 2, 2)


# ----- files --------------------------------------------------------------------------------------
TOML = """
[tiers]
write_policy = "write_back"
host_ratio = 3.0
host_layout = "layer_first"

[prefetch]
stop_policy = "best_effort"
threshold_tokens = 64
timeout_max_s = 10.0

[storage]
url = "memory://"
required = true
admission = "hit_threshold"
"""


def _check_loaded(config: HiCacheConfig) -> None:
    assert config.tiers == TierConfig(
        write_policy=WritePolicy.WRITE_BACK, host_ratio=3.0, host_layout=Layout.LAYER_FIRST
    )
    assert config.prefetch == PrefetchConfig(
        stop_policy=PrefetchStopPolicy.BEST_EFFORT, threshold_tokens=64, timeout_max_s=10.0
    )
    assert config.storage == StorageConfig(
        url="memory://", required=True, admission=L3Admission.HIT_THRESHOLD
    )


def test_toml_file_loads_into_the_dataclasses(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "hicache.toml"
    path.write_text(TOML)
    _check_loaded(load_config(path))


def test_json_file_loads_the_same(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "hicache.json"
    path.write_text(
        json.dumps(
            {
                "tiers": {
                    "write_policy": "write_back",
                    "host_ratio": 3.0,
                    "host_layout": "layer_first",
                },
                "prefetch": {
                    "stop_policy": "best_effort",
                    "threshold_tokens": 64,
                    "timeout_max_s": 10,
                },
                "storage": {"url": "memory://", "required": True, "admission": "hit_threshold"},
            }
        )
    )
    _check_loaded(load_config(path))


def test_an_empty_file_gives_the_defaults(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "empty.toml"
    path.write_text("")
    assert load_config(path) == HiCacheConfig()


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("bad.yaml", "tiers: {}", ".toml or .json"),
        ("bad.toml", "[tiers\n", "not valid toml"),
        ("bad.json", "{", "not valid json"),
        ("list.json", "[1, 2]", "top level"),
    ],
)
def test_a_bad_file_names_itself(tmp_path: pathlib.Path, name: str, text: str, says: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=says) as info:
        load_config(path)
    assert name in str(info.value)


def test_a_missing_file_is_a_config_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml")


# ----- flags --------------------------------------------------------------------------------------
def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_hicache_flags(parser)
    return parser.parse_args(list(argv))


def test_flags_override_the_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "hicache.toml"
    path.write_text(TOML)
    args = _parse(
        "--config", str(path),
        "--write-policy", "write_through_selective",
        "--prefetch-policy", "timeout",
        "--prefetch-threshold", "128",
        "--prefetch-timeout-base", "0.5",
        "--l3", "file:///tmp/l3",
        "--l3-compress", "true",
    )  # fmt: skip
    config = config_from_args(args)
    assert config.tiers.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
    assert config.tiers.host_ratio == 3.0  # from the file: no flag given
    assert config.prefetch.stop_policy is PrefetchStopPolicy.TIMEOUT
    assert config.prefetch.threshold_tokens == 128
    assert config.prefetch.timeout_base_s == 0.5
    assert config.prefetch.timeout_max_s == 10.0  # from the file
    assert config.storage.url == "file:///tmp/l3"
    assert config.storage.compress is True
    assert config.storage.required is True  # from the file
    check_config(config, PAGE)


def test_flags_without_a_file_start_from_the_defaults() -> None:
    config = config_from_args(_parse("--l3", "none", "--l3-required", "--host-pages", "7"))
    assert config.storage.url is None and config.storage.required is True
    assert config.tiers.host_pages == 7
    assert config.prefetch == PrefetchConfig()


# ----- refusals -----------------------------------------------------------------------------------
def test_write_back_without_host_is_refused_saying_what_to_change() -> None:
    config = config_from_args(_parse("--no-host", "--write-policy", "write_back", "--l3", "none"))
    with pytest.raises(ConfigError, match="write_back") as info:
        check_config(config, PAGE)
    assert "enable the host tier" in str(info.value)


def test_l3_without_host_is_refused() -> None:
    config = config_from_args(_parse("--no-host", "--l3", "memory://"))
    with pytest.raises(ConfigError, match="enable the host tier"):
        check_config(config, PAGE)


def test_prefetch_threshold_below_the_page_size_is_refused() -> None:
    config = config_from_args(_parse("--prefetch-threshold", "2"))
    with pytest.raises(ConfigError, match=r"below the page size 4; set it to at least 4"):
        check_config(config, PAGE)
    check_config(config, 2)  # the same threshold is fine with 2-token pages


def test_unknown_l3_scheme_lists_the_registered_backends() -> None:
    config = HiCacheConfig(storage=StorageConfig(url="bogus://somewhere"))
    with pytest.raises(ConfigError) as info:
        check_config(config, PAGE)
    message = str(info.value)
    assert "bogus" in message
    for scheme in ("file://", "memory://", "s3://", "shm://"):
        assert scheme in message


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"tierz": {}}, "unknown config table"),
        ({"tiers": {"write_polcy": "write_back"}}, "unknown option"),
        ({"prefetch": {"stop_policy": "sometimes"}}, "best_effort, wait_complete, timeout"),
        ({"storage": {"admission": "most"}}, "all, hit_threshold"),
        ({"tiers": {"write_threshold": "many"}}, "write_threshold"),
        ({"storage": "memory://"}, "must be a table"),
    ],
)
def test_bad_tables_options_and_values_are_refused(data: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        config_from_mapping(data)


def test_a_bad_enum_flag_is_refused() -> None:
    with pytest.raises(ConfigError, match="write_through, write_through_selective, write_back"):
        config_from_args(_parse("--write-policy", "write_sometimes"))


@pytest.mark.parametrize(
    ("section", "change", "says"),
    [
        ("prefetch", {"capacity_share": 0.0}, "capacity_share"),
        ("prefetch", {"capacity_share": 1.5}, "capacity_share"),
        ("storage", {"write_queue_pages": 0}, "write_queue_pages must be positive"),
        ("storage", {"op_deadline_s": 0.0}, "op_deadline_s must be positive"),
        ("tiers", {"host_pages": 0}, "host_pages must be positive"),
    ],
)
def test_out_of_range_values_are_refused(section: str, change: dict, says: str) -> None:
    config = HiCacheConfig().with_changes(section, **change)
    with pytest.raises(ConfigError, match=says):
        check_config(config, PAGE)


# ----- an unreachable L3 --------------------------------------------------------------------------
def _unreachable(tmp_path: pathlib.Path) -> str:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return f"file://{blocker}/l3"  # a root below a regular file can never be created


async def test_unreachable_l3_starts_with_l3_off_and_counts_it(tmp_path: pathlib.Path) -> None:
    async with await Harness.build(url=_unreachable(tmp_path)) as h:
        stats = h.controller.stats()
        assert stats["l3_unavailable"] == 1.0
        assert stats["l3_enabled"] == 0.0
        assert not h.controller.storage.enabled
        # the cache still serves, from device and host, and never tries L3
        assert h.run_request("a", list(range(1, 17)))["computed"] == 16
        h.tree.evict(10**6)
        assert h.run_request("b", list(range(1, 17)))["host"] == 16
        assert h.controller.metrics.counts["prefetch_started"] == 0


async def test_unreachable_required_l3_is_a_typed_error(tmp_path: pathlib.Path) -> None:
    url = _unreachable(tmp_path)
    with pytest.raises(BackendError, match=r"required \(storage.required\)") as info:
        await Harness.build(url=url, storage=StorageConfig(required=True))
    assert url in str(info.value)


async def test_reachable_l3_is_enabled(tmp_path: pathlib.Path) -> None:
    async with await Harness.build(
        url=f"file://{tmp_path}/l3", storage=StorageConfig(required=True)
    ) as h:
        assert h.controller.stats()["l3_enabled"] == 1.0
        assert h.controller.stats()["l3_unavailable"] == 0.0
