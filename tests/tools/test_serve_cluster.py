"""``hicache serve --http --workers N``: worker processes behind a router process, driven through
a real HTTP client. A prefix computed on one worker is an L3 hit on another (they share the
file L3); the cache-aware router keeps a prefix on one worker; a killed worker is set aside and
started again, its streamed request ending with an error naming it while the others are
served; a worker that cannot start makes ``serve`` exit with its error and leaves no process
behind; L3 credentials reach the workers in their environment, not on their command lines.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_kit import Served, serve_argv, serving

from hicache.server.workers import worker_argv

PROMPT = list(range(1, 97))  # 6 pages of 16


def test_worker_command_lines_drop_the_router_flags() -> None:
    argv = ["-v", "serve", "--http", "0.0.0.0:80", "--workers=4", "--router", "round_robin",
            "--seed", "3", "--http=1.2.3.4:5"]  # fmt: skip
    assert worker_argv(argv) == ["-v", "serve", "--seed", "3", "--http", "127.0.0.1:0"]


def test_worker_command_lines_drop_the_routers_keys_and_take_its_token() -> None:
    argv = ["serve", "--api-key", "k" * 12, "--api-keys=keys", "--insecure-no-auth",
            "--rate-limit", "5", "--share-cache", "--workers", "2", "--l3", "s3://K:S@b",
            "--admin-api-key-file=f", "--max-priority", "3", "--worker-ca-file", "ca"]  # fmt: skip
    assert worker_argv(argv, token_file="/run/t") == [
        "serve", "--share-cache", "--http", "127.0.0.1:0", "--internal-token-file", "/run/t"
    ]  # fmt: skip


def cli(*args: str) -> list[str]:
    return serve_argv(*args)


@contextmanager
def cluster(l3: pathlib.Path, workers: int, router: str, *extra: str) -> Iterator[Served]:
    argv = cli("--http", "127.0.0.1:0", "--workers", str(workers), "--router", router,
               "--l3", f"file://{l3}", *extra)  # fmt: skip
    with serving(argv) as served:
        yield served
    assert "workers stopped" in served.stderr, served.stderr


def complete(url: str, prompt: list[int], tokens: int = 2) -> dict[str, Any]:
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": tokens,
                        "temperature": 0}, timeout=60)  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def value(url: str, name: str, **labels: str) -> float:
    return samples(url).get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until(check: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_round_robin_reads_another_workers_prefix_from_l3(tmp_path: pathlib.Path) -> None:
    with cluster(tmp_path / "l3", 2, "round_robin") as served:
        url = served.url
        first = complete(url, PROMPT)  # worker 0 computes it and writes it through to L3
        wait_until(lambda: value(url, "hicache_pages_written_l3_total", worker="0") >= 5)
        second = complete(url, PROMPT)  # worker 1 reads it back
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert value(url, "hicache_request_hit_tokens_total", tier="l3", worker="1") >= 64
        assert value(url, "hicache_router_requests_total", worker="0", outcome="answered") == 1
        assert value(url, "hicache_router_requests_total", worker="1", outcome="answered") == 1
        # The L3 URL (credentials and all, when it has them) is in the worker's environment,
        # which only its user reads, and not on its command line, which everyone does.
        proc = pathlib.Path(f"/proc/{served.worker_pid(0)}")
        assert str(tmp_path / "l3") not in proc.joinpath("cmdline").read_bytes().decode()
        assert (
            f"HICACHE_L3_URL=file://{tmp_path / 'l3'}"
            in proc.joinpath("environ").read_bytes().decode()
        )


def test_cache_aware_keeps_a_prefix_on_one_worker(tmp_path: pathlib.Path) -> None:
    with cluster(tmp_path / "l3", 2, "cache_aware") as served:
        url = served.url
        for _ in range(3):
            complete(url, PROMPT)
        counts = [value(url, "hicache_router_requests_total", worker=str(w), outcome="answered")
                  for w in range(2)]  # fmt: skip
        assert sorted(counts) == [0, 3]
        home = counts.index(3)
        assert value(url, "hicache_request_hit_tokens_total", tier="device", worker=str(home)) > 0


SLOW = ("--hidden", "512", "--layers", "8", "--heads", "8", "--head-dim", "64")  # decodes 400
# tokens in seconds: a kill lands while the request runs


def test_a_killed_worker_is_set_aside_then_started_again(tmp_path: pathlib.Path) -> None:
    with cluster(tmp_path / "l3", 2, "round_robin", *SLOW) as served:
        url = served.url
        pid0 = served.worker_pid(0)
        body = {"prompt": PROMPT, "max_tokens": 400, "stream": True, "temperature": 0}
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            for line in stream.iter_lines():  # the first request goes to worker 0
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 3:
                        os.kill(pid0, signal.SIGKILL)  # mid-stream
        assert "worker 0 failed" in events[-1], events[-3:]
        for _ in range(4):  # all to worker 1 while worker 0 is away
            complete(url, [5, 6, 7])
        assert value(url, "hicache_router_requests_total", worker="1", outcome="answered") == 4
        served.said(r"worker 0 exited \(status -9\): starting it again")
        again = served.said(r"worker 0 started again \(pid (\d+)\)", timeout_s=120)
        assert int(again.group(1)) != pid0 and served.worker_pid(0) == int(again.group(1))
        wait_until(lambda: value(url, "hicache_router_workers_alive") == 2, timeout_s=120)
        for _ in range(2):
            complete(url, [5, 6, 7])
        assert value(url, "hicache_router_requests_total", worker="0", outcome="answered") >= 1


def test_workers_die_with_a_router_killed_outright(tmp_path: pathlib.Path) -> None:
    argv = cli("--http", "127.0.0.1:0", "--workers", "2", "--l3", f"file://{tmp_path / 'l3'}")
    with serving(argv) as served:
        pids = [served.worker_pid(0), served.worker_pid(1)]
        served.kill()  # SIGKILL: the router stops nothing itself
    wait_until(lambda: not any(_running(pid) for pid in pids), timeout_s=30)


def _running(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # a whole subprocess end to end: out of `-m "not slow"`
def test_a_worker_that_cannot_start_stops_serve_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    marker = str(tmp_path / "unique-cache-dir")
    # A required L3 that nothing listens on: the router does not open L3, each worker must.
    nowhere = "mooncake://127.0.0.1:1?metadata_server=http://127.0.0.1:1/metadata"
    argv = cli("--http", "127.0.0.1:0", "--workers", "2", "--cache-dir", marker, "--l3-required",
               "--l3", nowhere)  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "worker" in done.stderr and "failed to start" in done.stderr
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, marker)]
    assert left == []


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_mooncake_auto_is_the_shared_l3_and_stops_with_serve(tmp_path: pathlib.Path) -> None:
    argv = cli("--http", "127.0.0.1:0", "--workers", "2", "--router", "round_robin",
               "--l3", "mooncake://auto")  # fmt: skip
    with serving(argv) as served:
        url = served.url
        first = complete(url, PROMPT)
        wait_until(lambda: value(url, "hicache_pages_written_l3_total", worker="0") >= 5)
        second = complete(url, PROMPT)
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert value(url, "hicache_request_hit_tokens_total", tier="l3", worker="1") >= 64
        router = served.process.pid
        assert len(_masters_of(router)) == 1
    assert "started mooncake_master" in served.stderr
    assert _masters_of(router) == [], "the master outlived serve"


def _masters_of(parent: int) -> list[int]:
    """Pids of the mooncake_master processes whose parent is ``parent``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, _, rest = stat.partition(") ")
        if name.endswith("(mooncake_master") and int(rest.split()[1]) == parent:
            out.append(int(pid))
    return out


def _total(url: str, name: str) -> float:
    return sum(v for (n, _), v in samples(url).items() if n == name)


def test_a_killed_mooncake_master_is_restarted_and_l3_comes_back(tmp_path: pathlib.Path) -> None:
    argv = cli("--http", "127.0.0.1:0", "--workers", "2", "--router", "round_robin",
               "--l3", "mooncake://auto")  # fmt: skip
    with serving(argv) as served:
        url, router = served.url, served.process.pid
        complete(url, PROMPT)
        wait_until(lambda: _total(url, "hicache_pages_written_l3_total") >= 5)
        [master] = _masters_of(router)
        os.kill(master, signal.SIGKILL)
        for i in range(4):  # served without L3 meanwhile, its failures counted
            complete(url, [i + 1] * 80)
        wait_until(lambda: _total(url, "hicache_l3_write_failures_total") > 0)
        wait_until(lambda: len(_masters_of(router)) == 1 and _masters_of(router) != [master])
        written = _total(url, "hicache_pages_written_l3_total")
        fresh = iter(range(100, 200))

        def writes_again() -> bool:
            complete(url, [next(fresh)] * 80)  # new pages: written through once L3 is back
            return _total(url, "hicache_pages_written_l3_total") > written

        wait_until(writes_again, timeout_s=60)
    assert "mooncake_master is back" in served.stderr
    assert _masters_of(router) == []


def test_a_worker_killed_under_a_whole_answer_gives_a_502(tmp_path: pathlib.Path) -> None:
    with cluster(tmp_path / "l3", 2, "round_robin", *SLOW) as served:
        url = served.url
        pid0 = served.worker_pid(0)
        body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
            # round-robin's first goes to worker 0: kill it while it decodes the 400 tokens
            wait_until(lambda: value(url, "hicache_requests_in_flight", worker="0") == 1)
            os.kill(pid0, signal.SIGKILL)
            failed = answer.result()
        assert failed.status_code == 502, failed.text
        message = failed.json()["error"]["message"]
        assert "worker 0 failed" in message
        assert "127.0.0.1" not in message and "Connect" not in message  # no internal address
        assert complete(url, [5, 6, 7])["choices"][0]["token_ids"]  # worker 1 serves on


def test_the_router_enforces_keys_and_tenants_and_workers_take_only_its_token(
    tmp_path: pathlib.Path,
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-alice-router-01 alice\nsk-bob-router-0002 bob\n")
    with cluster(tmp_path / "l3", 2, "cache_aware", "--api-keys", str(keys)) as served:
        url = served.url
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}

        def post(key: str | None, target: str = url) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.post(f"{target}/v1/completions", json=body, headers=headers, timeout=60)

        assert post(None).status_code == 401 and post("sk-wrong-key-0003").status_code == 401
        assert post("sk-alice-router-01").status_code == 200
        hit = post("sk-alice-router-01").json()["usage"]["prompt_tokens_details"]
        assert hit["cached_tokens"] > 0  # alice hits her own prefix, on its worker
        bob = post("sk-bob-router-0002").json()["usage"]["prompt_tokens_details"]
        assert bob["cached_tokens"] == 0  # another tenant's prefix is a miss, on any worker
        alice = {"Authorization": "Bearer sk-alice-router-01"}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat, headers=alice, timeout=60)
        assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"
        models = httpx.get(f"{url}/v1/models", headers=alice, timeout=10).json()
        assert [m["object"] for m in models["data"]] == ["model"]
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}  # strangers
        shown = httpx.get(f"{url}/health", headers=alice, timeout=10).json()
        assert [w["alive"] for w in shown["workers"]] == [True, True]
        assert "127.0.0.1" not in json.dumps(shown)  # no internal address, even to a tenant
        for index in (0, 1):  # around the router: no key of a tenant opens a worker
            assert post("sk-alice-router-01", served.worker_url(index)).status_code == 401
            assert post(None, served.worker_url(index)).status_code == 401


def test_a_router_over_workers_started_apart_checks_them_and_retires_a_dead_one(
    tmp_path: pathlib.Path,
) -> None:
    token = tmp_path / "internal-token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    keys = tmp_path / "keys"
    keys.write_text("sk-alice-remote-01 alice\n")
    worker = cli("--http", "127.0.0.1:0", "--l3", f"file://{tmp_path / 'l3'}",
                 "--internal-token-file", str(token))  # fmt: skip
    with serving(worker) as first, serving(worker) as second:
        router = cli("--http", "127.0.0.1:0", "--worker", first.url, "--worker", second.url,
                     "--internal-token-file", str(token), "--api-keys", str(keys))  # fmt: skip
        with serving(router) as routed:
            body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
            alice = {"Authorization": "Bearer sk-alice-remote-01"}
            for _ in range(2):
                answer = httpx.post(f"{routed.url}/v1/completions", json=body, headers=alice,
                                    timeout=60)  # fmt: skip
                assert answer.status_code == 200, answer.text
            assert (
                httpx.post(f"{routed.url}/v1/completions", json=body, timeout=60).status_code == 401
            )
            direct = httpx.post(f"{first.url}/v1/completions", json=body, headers=alice, timeout=60)
            assert direct.status_code == 401  # a worker takes the router's token only
            second.kill()
            wait_until(lambda: [w["alive"] for w in httpx.get(f"{routed.url}/health",
                                headers=alice, timeout=10).json()["workers"]]
                       == [True, False])  # fmt: skip
            for _ in range(3):  # all to the worker left
                answer = httpx.post(f"{routed.url}/v1/completions", json=body, headers=alice,
                                    timeout=60)  # fmt: skip
                assert answer.status_code == 200, answer.text
