"""The cases of the hostile-client campaign (tests/campaign_server.py) and what they share: the
keys, the tally, the server processes and the running mode each case is played against.

Each case sends what a hostile (or merely careless) client would and counts the outcome in a
:class:`Tally`: a refusal that must come (an HTTP status, a closed connection, an exit status),
a thing that must hold (a request served, a worker kept), a secret seen where it must not be,
a cross-tenant cache hit.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import pathlib
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

ALICE, BOB, ADMIN = "sk-alice-campaign-1", "sk-bob-campaign-02", "sk-admin-campaign-3"
KEY_FILE_TEXT = f"{ALICE} alice max_priority=5\n{BOB} bob\n"  # alice may ask for priority 5
SECRETS = ("AKIDCAMPAIGN", "sEcReT-campaign", "zq9-token")
# An engine of 16 slots, and a tenant may hold 2 of them: with more, one tenant's requests
# in flight take every slot and another's wait for one to free (docs/BENCHMARKS.md).
MODEL = ["--hidden", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim",
         "64", "--vocab", "4096", "--device-tokens", "16384", "--max-running", "16"]  # fmt: skip
RATE_PER_S, MAX_CONCURRENT, PER_CLIENT = 50, 2, 64  # the limits every mode is started with
LIMIT_FLAGS = ["--rate-limit", str(RATE_PER_S), "--max-concurrent", str(MAX_CONCURRENT),
               "--max-connections-per-client", str(PER_CLIENT), "--max-body-bytes", "65536",
               "--write-timeout", "2", "--header-timeout", "2"]  # fmt: skip
HEADER_TIMEOUT_S = 2.0
BOB_ADDRESS = "127.0.0.2"  # the hostile tenant's own client address (loopback all the same)
RETIRED = "no more requests go to it"  # the router's log line when it sets a worker aside
V1 = "/v1/completions"
RAW_KEY: Any = {"Authorization": b"Bearer sk-\xff\xfe-not-utf8"}  # bytes that are not UTF-8


@dataclass
class Tally:
    tried: int = 0
    refused_right: int = 0
    expected_refusals: int = 0
    secrets_leaked: int = 0
    cross_tenant_hits: int = 0
    crashes: int = 0
    wrong: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)  # server log lines shown with wrong ones
    hidden: list[str] = field(default_factory=lambda: [*SECRETS, ALICE, BOB, ADMIN])

    def refusal(self, what: str, answer: httpx.Response, status: int) -> None:
        self.refused(what, answer.status_code == status, f"{answer.status_code}, wanted {status}")
        self.leaks(answer.text, internal=answer.status_code >= 500)

    def refused(self, what: str, right: bool, got: str = "") -> None:
        """A refusal that must come: an HTTP status, a closed connection, an exit status."""
        self.tried += 1
        self.expected_refusals += 1
        self.refused_right += int(right)
        if not right:
            self.wrong.append(f"{what}: {got}")

    def check(self, what: str, ok: bool, got: str = "") -> None:
        """Something that must hold: a request served, a worker kept, a floor met."""
        self.tried += 1
        if not ok:
            self.wrong.append(f"{what}: {got}" if got else what)

    def leaks(self, text: str, internal: bool = False) -> None:
        """Count a secret (or key) in ``text``; ``internal``: a server error's body, which must
        not name an internal address either."""
        found = [s for s in self.hidden if s in text]
        if internal and "127.0.0.1" in text:
            found.append("127.0.0.1")
        self.secrets_leaked += len(found)


class Proc:
    """A server process of the campaign: its URL from its first stdout line; its stderr read by
    a thread as it comes (a full pipe would stall the server)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        self.lines: list[str] = []
        self.killed = False  # by the campaign, on purpose: not a crash
        self.url = ""
        assert self.popen.stderr is not None
        self._reader = threading.Thread(
            target=lambda: self.lines.extend(iter(self.popen.stderr.readline, "")), daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_url(self) -> str:
        """The URL it serves on (its first stdout line); RuntimeError if it did not start."""
        assert self.popen.stdout is not None
        first = self.popen.stdout.readline()
        if " on https://" not in first:
            self.popen.wait(30)
            self._reader.join(10)
            raise RuntimeError(f"{self.name} did not start: {first!r}\n{self.stderr[-3000:]}")
        stdout = self.popen.stdout
        threading.Thread(target=lambda: stdout.read(), daemon=True).start()  # drained
        self.url = first.rsplit(" ", 1)[1].strip()
        return self.url

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def count(self, pattern: str) -> int:
        return sum(bool(re.search(pattern, line)) for line in list(self.lines))

    def kill(self) -> None:
        self.killed = True
        self.popen.kill()
        self.popen.wait()

    def stop(self) -> int | None:
        """SIGTERM, then its exit status (None if it had to be killed)."""
        if self.popen.poll() is None:
            self.popen.terminate()
        try:
            code: int | None = self.popen.wait(90)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            code = None
        self._reader.join(30)
        return code


@dataclass
class Target:
    """One mode running: where its clients go, and its processes."""

    mode: str  # single, router or remote
    url: str
    ctx: ssl.SSLContext  # trusts the campaign's self-signed certificate
    root: pathlib.Path
    keys_file: pathlib.Path
    keeper: Proc  # the process holding the keys: the single server or the router
    procs: list[Proc]  # every process of the mode, the keeper first
    workers: list[Proc] = field(default_factory=list)  # remote mode: the workers it started
    forbidden: list[str] = field(default_factory=list)  # never on a command line
    worker_forbidden: list[str] = field(default_factory=list)  # nor on a local worker's
    token: str | None = None  # remote mode: the workers' internal token

    @property
    def cluster(self) -> bool:
        return self.mode != "single"

    @property
    def metric_prefix(self) -> str:
        return "hicache_router" if self.cluster else "hicache"


def client(t: Target, timeout: float = 60.0, connections: int = 32) -> httpx.AsyncClient:
    # Fewer connections than --max-connections-per-client: past it the server closes them.
    limits = httpx.Limits(max_connections=connections)
    return httpx.AsyncClient(base_url=t.url, verify=t.ctx, timeout=timeout, limits=limits)


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def completion(c: httpx.AsyncClient, key: str, prompt: Any, **extra: Any) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    return await c.post(V1, json=body, headers=headers(key))


def cached(answer: httpx.Response) -> int:
    """The answer's cached prompt tokens; -1 for an answer that is not a 200."""
    if answer.status_code != 200:
        return -1
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def metric_sum(text: str, name: str) -> float:
    """The sum of the samples of ``name`` (any labels) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def metrics(t: Target) -> str:
    async with client(t, connections=1) as c:
        answer = await c.get("/metrics", headers=headers(ALICE))
    return answer.text


async def settled(t: Target, timeout_s: float = 15.0) -> bool:
    """Whether the mode's requests in flight (every worker's) come back to 0 in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metric_sum(await metrics(t), "hicache_requests_in_flight") == 0:
            return True
        await asyncio.sleep(0.1)
    return False


async def waited(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def address(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


# ----- TLS, refusals, bodies ------------------------------------------------------------------
async def tls_cases(t: Target, tally: Tally) -> None:
    """Every listener of the mode serves https, and plain HTTP to it gets no HTTP answer."""
    urls = [t.url, *(w.url for w in t.workers)]
    for url in urls:
        tally.check(f"{url} is https", url.startswith("https://"))
        try:
            async with httpx.AsyncClient(timeout=10.0) as plain:
                answer = await plain.get(f"{url.replace('https://', 'http://', 1)}/health")
            tally.refused(f"plain HTTP to {url}", False, f"an HTTP {answer.status_code}")
        except httpx.HTTPError:
            tally.refused(f"plain HTTP to {url}", True)


async def refusals(c: httpx.AsyncClient, tally: Tally, figures: dict[str, Any]) -> None:
    tally.refusal("no key", await completion(c, "", [1, 2, 3]), 401)
    tally.refusal("wrong key", await completion(c, "sk-wrong-key-000", [1, 2, 3]), 401)
    body = b"[" + b"1," * 40_000 + b"1]"
    answer = await c.post(V1, content=body, headers=headers(BOB))
    tally.refusal("oversized body", answer, 413)
    tally.refusal("bad cache_salt", await completion(c, BOB, [1, 2], cache_salt=""), 400)
    await malformed(c, tally)
    await priorities(c, tally)
    started = time.perf_counter()
    answer = await completion(c, ALICE, "x" * 60_000)  # more characters than context tokens
    figures["long_prompt_400_ms"] = round((time.perf_counter() - started) * 1e3, 1)
    tally.refusal("a text prompt longer than the context", answer, 400)


async def malformed(c: httpx.AsyncClient, tally: Tally) -> None:
    """Bodies that cost CPU or raised before: deep JSON, a 5000-digit integer, an unhashable
    chat role, a key byte that is not UTF-8."""
    json_headers = {**headers(ALICE), "Content-Type": "application/json"}
    deep = b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    answer = await c.post(V1, content=deep, headers=json_headers)
    tally.refusal("JSON nested 30000 deep", answer, 400)
    digits = b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}"
    answer = await c.post(V1, content=digits, headers=json_headers)
    tally.refusal("a 5000-digit integer", answer, 400)
    chat = {"messages": [{"role": [], "content": "hi"}], "max_tokens": 1}
    answer = await c.post("/v1/chat/completions", json=chat, headers=headers(ALICE))
    tally.refusal("a chat role that is a list", answer, 400)
    answer = await c.post(V1, json={"prompt": [1], "max_tokens": 1}, headers=RAW_KEY)
    tally.refusal("a non-UTF-8 byte in the key", answer, 401)


async def priorities(c: httpx.AsyncClient, tally: Tally) -> None:
    """The server's cap is 0; the key file gives alice (only) a cap of 5."""
    answer = await completion(c, BOB, [1, 2], priority=1)
    tally.refusal("priority over the server's cap", answer, 400)
    answer = await completion(c, ALICE, [1, 2], priority=5)
    tally.check("priority within the tenant's own cap", answer.status_code == 200,
                str(answer.status_code))  # fmt: skip
    answer = await completion(c, ALICE, [1, 2], priority=6)
    tally.refusal("priority over the tenant's own cap", answer, 400)


# ----- admin, L3 allow-list -------------------------------------------------------------------
def allow_flags(root: pathlib.Path) -> list[str]:
    rules = [f"file://{root}/allowed/", "s3://kvcache", "mooncake://10.0.0.5"]
    return [flag for rule in rules for flag in ("--l3-allow", rule)]


def outside_the_rules(root: pathlib.Path) -> list[str]:
    """Attach URLs no rule of :func:`allow_flags` admits: another backend, options the rules
    do not name, another bucket or host, ``..`` however encoded."""
    return [
        f"nixl://{root}/allowed/x?plugin=obj&bucket=b&endpoint_url=http://127.0.0.1:9",
        f"file://{root}/allowed/x?io_threads=1000000",
        f"file://{root}/allowed/x?read_only=true",
        "s3://kvcache-other/x",
        "mooncake://10.0.0.50:50051",
        f"hf3fs://{root}/allowed/../../etc",
        f"3fs://{root}/allowed/%2e%2e/%2e%2e/etc",
        f"file://{root}/allowed/%252e%252e/x",
    ]


async def admin_cases(c: httpx.AsyncClient, t: Target, tally: Tally) -> None:
    if t.cluster:  # a router has no admin routes
        answer = await c.post("/admin/flush", json={}, headers=headers(ALICE))
        tally.refusal("an admin route on the router", answer, 404)
        return
    answer = await c.post("/admin/flush", json={}, headers=headers(ALICE))
    tally.refusal("tenant key on admin", answer, 403)

    async def attach(url: str) -> httpx.Response:
        return await c.post("/admin/l3/attach", json={"url": url}, headers=headers(ADMIN))

    tally.refusal("attach outside the allow-list",
                  await attach("file:///tmp/hicache-campaign-elsewhere"), 403)  # fmt: skip
    url = (f"s3://{SECRETS[0]}:{SECRETS[1]}@bucket/kv?endpoint_url=http://127.0.0.1:9"
           f"&token={SECRETS[2]}")  # fmt: skip
    tally.refusal("attach with secrets", await attach(url), 403)
    failing = f"file://{t.root}/allowed/x?secret={SECRETS[2]}"
    tally.refusal("attach an L3 that fails, with a secret", await attach(failing), 400)
    for url in outside_the_rules(t.root):
        tally.refusal(f"attach {url.replace(str(t.root), 'ROOT')}", await attach(url), 403)


# ----- tenants --------------------------------------------------------------------------------
async def isolation(c: httpx.AsyncClient, tally: Tally) -> None:
    for i in range(5):
        prompt = [(97 * i + 7 * j) % 4000 for j in range(256)]
        for _ in range(2):  # once per worker of a round-robin router: each holds her prefix
            await completion(c, ALICE, prompt)
        again = await completion(c, ALICE, prompt)  # alice hits her own prefix
        bob = await completion(c, BOB, prompt)
        salted = await completion(c, ALICE, prompt, cache_salt="other")
        tally.tried += 5
        if cached(again) <= 0:
            tally.wrong.append(f"alice missed her own prefix ({again.status_code})")
        if -1 in (cached(bob), cached(salted)):
            tally.wrong.append(f"isolation: {bob.status_code}, {salted.status_code}")
        tally.cross_tenant_hits += int(cached(bob) > 0) + int(cached(salted) > 0)


async def router_health(c: httpx.AsyncClient, tally: Tally) -> None:
    """A router's /health says only its status without a key; its workers with one."""
    answer = await c.get("/health")
    tally.check("router /health without a key is its status only",
                answer.status_code == 200 and answer.json() == {"status": "ok"},
                answer.text)  # fmt: skip
    tally.leaks(answer.text, internal=True)
    workers = (await c.get("/health", headers=headers(ALICE))).json().get("workers", [])
    tally.check("router /health with a key lists its workers", len(workers) == 2, str(workers))


async def straight_to_workers(t: Target, tally: Tally) -> None:
    """A remote worker takes the router's token alone: a tenant key sent to it is a 401."""
    for worker in t.workers:
        async with httpx.AsyncClient(base_url=worker.url, verify=t.ctx, timeout=30.0) as c:
            answer = await completion(c, ALICE, [1, 2, 3])
            tally.refusal(f"a tenant key straight to {worker.name}", answer, 401)
            tally.refusal(f"no key straight to {worker.name}", await completion(c, "", [1]), 401)
            answer = await c.post(V1, json={"prompt": [1], "max_tokens": 1}, headers=RAW_KEY)
            tally.refusal(f"a non-UTF-8 byte in the key straight to {worker.name}", answer, 401)


async def key_reload(t: Target, tally: Tally) -> None:
    """An emptied key file and a SIGHUP to the key holder: the keys in force stay."""
    kept, logged = t.keys_file.read_text(), t.keeper.count("API keys not reloaded")
    t.keys_file.write_text("")
    os.kill(t.keeper.pid, signal.SIGHUP)
    refused = await waited(lambda: t.keeper.count("API keys not reloaded") > logged)
    tally.check("a reload to an empty key file is refused and logged", refused)
    async with client(t) as c:
        answer = await completion(c, "", [1, 2, 3])
        tally.refusal("no key after the key file was emptied", answer, 401)
        answer = await completion(c, ALICE, [1, 2, 3])
        tally.check("alice's key kept after the key file was emptied",
                    answer.status_code == 200, str(answer.status_code))  # fmt: skip
    t.keys_file.write_text(kept)
    os.kill(t.keeper.pid, signal.SIGHUP)


# ----- process-level --------------------------------------------------------------------------
def cmdline_cases(t: Target, tally: Tally, pids: dict[str, int]) -> None:
    """No key or token on any process's command line, nor (router mode) the L3 URL on a
    worker's: the router's workers take it in their environment."""
    for name, pid in pids.items():
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        local_worker = t.mode == "router" and name.startswith("worker")
        forbidden = t.forbidden + (t.worker_forbidden if local_worker else [])
        found = [s for s in forbidden if s.encode() in cmdline]
        tally.tried += 1
        tally.secrets_leaked += len(found)
        if found:
            tally.wrong.append(f"{name}'s command line holds {len(found)} secret(s)")


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def dependency_floors(tally: Tally) -> None:
    for name, floor in (("aiohttp", (3, 12, 14)), ("jinja2", (3, 1, 6))):
        have = importlib.metadata.version(name)
        tally.check(f"{name} {have} is at least {floor}", version(have) >= floor)


def refused_at_start() -> list[tuple[str, str, subprocess.Popen[str]]]:
    """Command lines ``serve`` must refuse (exit 2), started at once so they run beside the
    mode's servers: (what, a word their error names, the process)."""
    base = [sys.executable, "-m", "hicache.tools.cli", "serve", *MODEL, "--http", "127.0.0.1:0"]
    cases = [("a rule of an unknown scheme", "--l3-allow", ["--l3-allow", "nosuch:///x"]),
             ("an abbreviated flag", "--rate-l", ["--rate-l", "5"])]  # fmt: skip
    return [(what, word, subprocess.Popen([*base, *extra], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
            for what, word, extra in cases]  # fmt: skip


def check_refused_at_start(launched: Sequence[Any], tally: Tally) -> None:
    for what, word, proc in launched:
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # it serves: it took what it should have refused
            proc.kill()
            _, stderr = proc.communicate()
        ok = proc.returncode == 2 and word in stderr
        tally.refused(f"serve with {what}", ok, f"exit {proc.returncode}")


def status_line(answer: bytes) -> int:
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def json_line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(", ", ": "))


def tls_socket(t: Target, source: str, rcvbuf: int | None = None) -> ssl.SSLSocket:
    """A TLS connection to the mode from ``source``; OSError when the server closes it."""
    host, port = address(t.url)
    raw = socket.socket()
    if rcvbuf is not None:  # before connect: the window the server sees is this small
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    raw.bind((source, 0))
    raw.settimeout(10.0)
    try:
        raw.connect((host, port))
        return t.ctx.wrap_socket(raw, server_hostname=host)
    except OSError:
        raw.close()
        raise
