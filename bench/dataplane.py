"""The block stream (docs/dataplane.md): store, load and reference throughput of 2 MiB blocks
through a real ``sessioncache serve`` process.

Default case, fresh nodes: stores into a node as README starts it (CPU tier 4 GiB, disk tier
on, stores written behind), its first ``--fresh-gib`` (2) of blocks through
``KVTransfer.store_from`` in chains of ``--chain`` (256) blocks, the write-behind queue drained
between chains (not timed). One new node per path (same host, stream) and per wait
``--after-s`` (0 and 3: used as soon as ``/healthz`` answers, and a few seconds after), its
client connecting in the first timed store; then as much again into the same node, warm by
then (``next``). References, each timed after every chain once the node's write-behind is
drained, totalled over the same chains: ``memcpy`` (numpy copies of the chain's blocks) and
``socket`` (below). The node's resident memory (anonymous + shared) is printed before its
first store and after its first ``--fresh-gib``. Targets, on the first ``--fresh-gib``:
same-host store >= 40% of memcpy, stream store >= 60% of the socket.

``--warm`` adds the earlier case, labelled *warm*: a node whose CPU tier holds four chains of
blocks (LRU), its first round not counted, or with ``--stripped`` one without its disk tier
(labelled so), printed beside references measured in the same run on the same bytes:

- memcpy:   numpy copies of the blocks between two arrays (the memory bound of this machine)
- socket:   a plain Python socket stream over loopback between two processes (``sendall`` of
            each block, ``recv_into`` a block-sized row, one connection for every round):
            what any TCP data plane here can do
- redis:    raw redis-py ``SET``/``GET`` of one block per key (another network store)
- REST:     ``PUT``/``GET /v1/blocks/{id}`` of the same node (``bench.transfer``)

Same host (``SameHostClient``, docs/dataplane.md "Same host"): the same blocks through the
node's shared-memory CPU tier, measured against memcpy. Store: STAGE of a fresh chain, each
payload checksummed (XXH3-64) and copied into its slot, COMMITs (which the node verifies) in
batches with one in flight. Load: LOCATE (leased) and ``load_into`` the array, then the checked
RELEASE. Targets: same-host load >= 70% of memcpy, store >= 50%.

glibc switches memcpy to non-temporal stores only above a size threshold; ``sessioncache
serve`` lowers it to 1 MiB for itself unless ``GLIBC_TUNABLES`` is set (even empty). The second
line says what the client (this process, where memcpy and the same-host copies run) and the
node ran with: ``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000 python -m
bench.dataplane`` tunes both, ``GLIBC_TUNABLES= python -m bench.dataplane`` neither.

Stream store: every round stores a fresh chain (all blocks missing) in one STORE, whose
payloads the client sends from its own array; the first round (faulting the tier's slabs in)
is not counted. Stream load: a LOOKUP leasing the last chain stored, then one LOAD by that
lease straight into a preallocated array (``load_into``), checked byte for byte once. Each
figure is the best of ``--repeats``. The target: stream load and store >= 70% of the socket.

Run: ``python -m bench.dataplane [--fresh-gib 2] [--chain 256] [--after-s 0,3] [--cpu-gib 4]
[--block-mib 2] [--warm [--blocks 512] [--repeats 3] [--redis redis://127.0.0.1:6379/0]]
[--json]``; ``--json`` adds one JSON object as the last line, GB/s by key (the fresh case's
as ``fresh_<wait>s_<case>``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from bench import compare
from bench.lookup import start
from bench.transfer import http_transfers, redis_set_get
from sessioncache.connector import StreamClient
from sessioncache.connector.samehost import SameHostClient
from sessioncache.hashing import Namespace

MiB = 1 << 20
TARGET = 0.70
SAME_HOST_TARGETS = {"same_host_load": 0.70, "same_host_store": 0.50}
"""Shares of memcpy."""


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def blocks_of(n: int, size: int, seed: int = 0) -> np.ndarray:
    """``n`` distinct random blocks, faulted in."""
    out = np.empty((n, size), np.uint8)
    rng = np.random.default_rng(seed)
    for i in range(n):
        out[i] = rng.integers(0, 256, size, np.uint8)
    return out


def _socket_sender(port: int, n: int, size: int, repeat: int) -> None:
    """The sending process of ``SocketReference``: one connection, ``n`` blocks per round,
    each round sent when the receiver says go."""
    data = blocks_of(n, size, seed=1)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeat):
            if s.recv(1) != b"g":
                return
            for i in range(n):
                s.sendall(data[i].data)


class SocketReference:
    """A plain socket carrying ``n`` blocks from another process into the rows of an array
    here (``recv_into``), over one connection (kept, as the stream's is), once per ``run``."""

    def __init__(self, n: int, size: int, repeat: int) -> None:
        self.n, self.size = n, size
        self.out = np.zeros((n, size), np.uint8)
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            port = listener.getsockname()[1]
            self.sender = multiprocessing.get_context("spawn").Process(
                target=_socket_sender, args=(port, n, size, repeat), daemon=True
            )
            self.sender.start()
            self.conn, _ = listener.accept()

    def run(self) -> float:
        t0 = time.perf_counter()
        self.conn.sendall(b"g")
        for i in range(self.n):
            view = self.out[i].data
            got = 0
            while got < self.size:
                k = self.conn.recv_into(view[got:])
                if not k:
                    raise RuntimeError("the sender stopped early")
                got += k
        return time.perf_counter() - t0

    def close(self) -> None:
        self.conn.close()
        self.sender.join(30)


class StreamCases:
    """STOREs of every block of ``data`` (a fresh chain each) and LOADs of the last chain
    stored, through the stream of the node at ``url``."""

    def __init__(self, url: str, data: np.ndarray) -> None:
        self.data = data
        self.rows = [data[i] for i in range(len(data))]
        self.client = StreamClient.discover(url)
        self.root = self.client.resolve(Namespace("bench-stream", 16, "bf16", "x"))
        self.out = np.zeros_like(data)
        self.views = [self.out[i] for i in range(len(data))]
        self.rounds = 0
        self.ids: list[bytes] = []

    def store(self) -> float:
        n = len(self.rows)
        rng = np.random.default_rng(100 + self.rounds)
        tokens = rng.integers(0, 100_000, n * 16, np.uint32)
        self.rounds += 1
        t0 = time.perf_counter()
        ack = self.client.store(self.root, tokens, self.rows)
        seconds = time.perf_counter() - t0
        if ack.stored != n:
            raise RuntimeError(f"{ack.stored} of {n} blocks stored")
        self.ids = ack.hashes
        return seconds

    def load(self) -> float:
        t0 = time.perf_counter()
        found = self.client.lookup(self.root, self.ids, lease_ms=60_000)
        if found.matched != len(self.ids):
            raise RuntimeError(f"{found.matched} of {len(self.ids)} blocks held")
        self.client.load_into(found, self.views, release=True)
        seconds = time.perf_counter() - t0
        if not np.array_equal(self.out, self.data):
            raise RuntimeError("the blocks loaded differ from the blocks stored")
        self.out.fill(0)
        return seconds

    def close(self) -> None:
        self.client.close()


class SameHostCases(StreamCases):
    """The same rounds through the node's same-host socket (shared memory)."""

    def __init__(self, url: str, data: np.ndarray) -> None:
        self.data = data
        self.rows = [data[i] for i in range(len(data))]
        self.client = SameHostClient.discover(url)
        self.root = self.client.resolve(Namespace("bench-samehost", 16, "bf16", "x"))
        self.out = np.zeros_like(data)
        self.views = [self.out[i] for i in range(len(data))]
        self.rounds = 0
        self.ids = []

    def load(self) -> float:
        assert isinstance(self.client, SameHostClient)
        t0 = time.perf_counter()
        found = self.client.locate(self.root, self.ids, lease_ms=60_000)
        if found.located != len(self.ids):
            raise RuntimeError(f"{found.located} of {len(self.ids)} blocks located")
        self.client.load_into(found, self.views)  # then the checked release
        seconds = time.perf_counter() - t0
        if not np.array_equal(self.out, self.data):
            raise RuntimeError("the blocks loaded differ from the blocks stored")
        self.out.fill(0)
        return seconds


FRESH_TARGETS = {"same_host": ("memcpy", 0.40), "stream": ("socket", 0.60)}
"""The fresh case's targets: a share of each path's reference."""


def node_memory(pid: int) -> int:
    """Resident bytes of a process: anonymous and shared (its memfd segments)."""
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssShmem:")):
            total += int(line.split()[1]) << 10
    return total


def fresh_node(
    path: str,
    after_s: float,
    args: argparse.Namespace,
    blocks: list[np.ndarray],
    reference: Callable[[], float],
) -> dict[str, float]:
    """The first ``--fresh-gib`` stored into a new README node ``after_s`` after it answers,
    then as much again (the node warm): each chain's ``reference`` timed once its write-behind
    is drained. GB/s of each half's stores and references, the node's memory before and
    after."""
    from bench.ingest import README_NODE, chain_tokens, drained, transfer

    size = blocks[0].nbytes
    chains = max(1, round(args.fresh_gib * (1 << 30)) // (len(blocks) * size))
    rng = np.random.default_rng(7)
    seconds = {"fresh": 0.0, "warm": 0.0, "fresh_ref": 0.0, "warm_ref": 0.0}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        cpu_bytes = int(args.cpu_gib * (1 << 30))
        proc, url = start(Path(tmp) / "data", cpu_bytes=cpu_bytes, extra_env=README_NODE)
        try:
            time.sleep(after_s)
            before = node_memory(proc.pid)
            kv = transfer(url, path, f"fresh-{path}")
            try:
                for i in range(2 * chains):
                    half = "fresh" if i < chains else "warm"
                    tokens = chain_tokens(rng, len(blocks))
                    t0 = time.perf_counter()
                    kept = kv.store_from(tokens, blocks).blocks
                    seconds[half] += time.perf_counter() - t0
                    if kept != len(blocks):
                        raise RuntimeError(f"{path}: {kept} of {len(blocks)} blocks kept")
                    drained(url)
                    seconds[f"{half}_ref"] += reference()
                    if i == chains - 1:
                        after = node_memory(proc.pid)
            finally:
                kv.close()
                kv.client.close()
        finally:
            proc.terminate()
            proc.wait(30)
    nbytes = chains * len(blocks) * size
    rates = {k: nbytes / v / 1e9 for k, v in seconds.items()}
    return {**rates, "rss_before": before, "rss_after": after}


def fresh(args: argparse.Namespace) -> dict[str, float]:
    """The default case (module docstring); GB/s by ``fresh_<wait>s_<case>``."""
    from bench.store_paths import memcpy

    size = int(args.block_mib * MiB)
    data = blocks_of(args.chain, size)
    blocks = [data[i] for i in range(len(data))]
    out = [np.empty(size, np.uint8) for _ in blocks]
    waits = [float(w) for w in args.after_s.split(",")]
    chains = max(1, round(args.fresh_gib * (1 << 30)) // (len(blocks) * size))
    socket_ref = SocketReference(len(blocks), size, 2 * chains * len(waits))
    references: dict[str, Callable[[], float]] = {
        "memcpy": lambda: memcpy(blocks, out),
        "socket": socket_ref.run,
    }
    results: dict[str, float] = {}
    gib = chains * len(blocks) * size / (1 << 30)
    print(
        f"fresh README node, CPU tier {args.cpu_gib:g} GiB: its first {gib:g} GiB through "
        f"KVTransfer.store_from ({chains} chains of {args.chain} x {args.block_mib:g} MiB), "
        f"then as much again (warm); GB/s, share of the reference"
    )
    print(
        f"{'after':>6} {'case':<10} {'first':>6} {'ref':>13} {'share':>6} {'target':>7} "
        f"{'next':>6} {'ref':>6} {'share':>6}  node memory before -> after first"
    )
    try:
        for wait in waits:
            for path, (ref, share) in FRESH_TARGETS.items():
                got = fresh_node(path, wait, args, blocks, references[ref])
                key = f"fresh_{wait:g}s_{path}"
                results[key] = got["fresh"]
                results[f"{key}_{ref}"] = got["fresh_ref"]
                results[f"{key}_warm"] = got["warm"]
                results[f"{key}_warm_{ref}"] = got["warm_ref"]
                first = got["fresh"] / got["fresh_ref"]
                print(
                    f"{wait:>5g}s {path:<10} {got['fresh']:6.2f} {ref:>6} {got['fresh_ref']:6.2f} "
                    f"{first:6.1%} {'met' if first >= share else 'missed':>7} "
                    f"{got['warm']:6.2f} {got['warm_ref']:6.2f} "
                    f"{got['warm'] / got['warm_ref']:6.1%}  "
                    f"{got['rss_before'] / (1 << 30):.2f} -> {got['rss_after'] / (1 << 30):.2f} GiB"
                )
    finally:
        socket_ref.close()
    for path, (ref, share) in FRESH_TARGETS.items():
        print(f"target: fresh {path} store >= {share:.0%} of {ref} (the same chains' total)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fresh-gib", type=float, default=2.0)
    parser.add_argument("--chain", type=int, default=256, help="blocks per fresh store")
    parser.add_argument("--after-s", default="0,3", help="waits after the node answers")
    parser.add_argument("--cpu-gib", type=float, default=4.0, help="the fresh node's CPU tier")
    parser.add_argument("--warm", action="store_true", help="also the warm case (below)")
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-mib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of GB/s")
    parser.add_argument(
        "--stripped", action="store_true", help="a node without its disk tier (not README's)"
    )
    compare.add_arguments(parser)
    args = parser.parse_args()
    references = {
        f"fresh_{w:g}s_{path}{half}": f"fresh_{w:g}s_{path}{half}_{ref}"
        for w in (float(x) for x in args.after_s.split(","))
        for path, (ref, _) in FRESH_TARGETS.items()
        for half in ("", "_warm")
    }
    references.update(
        {
            "stream_load": "socket",
            "stream_store": "socket",
            "same_host_load": "memcpy",
            "same_host_store": "memcpy",
            "rest_get": "redis_get",
            "rest_put": "redis_set",
        }
    )
    if compare.run_if_asked(
        args, "bench.dataplane", lower_is_better=lambda key: False, references=references
    ):
        return
    out: dict[str, float | None] = {k: round(v, 3) for k, v in fresh(args).items()}
    if args.warm:
        out.update(warm(args))
    if args.json:
        print(json.dumps(out))


def warm(args: argparse.Namespace) -> dict[str, float | None]:
    """The warm case (module docstring); GB/s by key."""
    n, size = args.blocks, int(args.block_mib * MiB)
    gb = n * size / 1e9
    data = blocks_of(n, size)

    # The socket, the stream and memcpy take turns, round after round, so that load from
    # elsewhere on this machine hits them alike; each keeps its best round.
    seconds: dict[str, float] = {}

    def keep(key: str, value: float) -> None:
        seconds[key] = min(seconds.get(key, value), value)

    reference = SocketReference(n, size, args.repeats)
    dst = np.zeros_like(data)
    with tempfile.TemporaryDirectory() as tmp:
        # Four chains, LRU: a store evicts the oldest chain, never the chain the other path
        # has just loaded, whose lease a LOAD with release may still hold for an instant after
        # its last block reached the client (two such leases stay within a tenant's pin
        # share; the default policy would keep the chains just read and drop the new one).
        node = {"SESSIONCACHE_EVICTION_POLICY": "lru"}
        if not args.stripped:
            node["SESSIONCACHE_DISK_BYTES"] = str(64 << 30)
        proc, url = start(Path(tmp) / "data", cpu_bytes=4 * n * size, extra_env=node)
        node_tunables = next(
            (
                e.decode().partition("=")[2]
                for e in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
                if e.startswith(b"GLIBC_TUNABLES=")
            ),
            "",
        )
        try:
            stream = StreamCases(url, data)
            same_host = SameHostCases(url, data)
            try:
                stream.store()  # faults the tier's slabs in: not counted
                same_host.store()  # maps the segments: not counted
                same_host.load()
                for _ in range(args.repeats):
                    keep("socket", reference.run())
                    keep("stream_store", stream.store())
                    keep("stream_load", stream.load())
                    keep("memcpy", best(lambda: [np.copyto(dst[i], data[i]) for i in range(n)], 1))
                    keep("same_host_store", same_host.store())
                    keep("same_host_load", same_host.load())
            finally:
                stream.close()
                same_host.close()
                reference.close()
            with httpx.Client(base_url=url, timeout=300) as c:
                http = http_transfers(c, n, data[0].tobytes())
            seconds["rest_put"], seconds["rest_get"] = http["put"], http["get"]
        finally:
            proc.terminate()
            proc.wait(10)
    seconds["redis_set"], seconds["redis_get"] = redis_set_get(args.redis, n, data[0].tobytes())

    rate = {k: gb / v for k, v in seconds.items()}
    label = (
        "warm: stripped node (no disk tier)"
        if args.stripped
        else "warm: README node (disk tier on)"
    )
    print(
        f"{label}: {n} blocks of {args.block_mib:g} MiB ({gb:.2f} GB per case), "
        f"best of {args.repeats}"
    )
    print(
        f"GLIBC_TUNABLES: client {os.environ.get('GLIBC_TUNABLES', '')!r}, node {node_tunables!r}"
    )
    print(f"{'case':<28} {'GB/s':>6}  {'/ socket':>8}  {'/ memcpy':>8}")
    names = [
        ("memcpy", "numpy memcpy"),
        ("socket", "plain socket, 2 processes"),
        ("stream_load", "stream LOAD (lease)"),
        ("stream_store", "stream STORE"),
        ("same_host_load", "same-host load (shm)"),
        ("same_host_store", "same-host store (shm)"),
        ("redis_get", "redis-py GET"),
        ("redis_set", "redis-py SET"),
        ("rest_get", "REST GET /v1/blocks/{id}"),
        ("rest_put", "REST PUT /v1/blocks/{id}"),
    ]
    for key, label in names:
        print(
            f"{label:<28} {rate[key]:6.2f}  {rate[key] / rate['socket']:8.1%}  "
            f"{rate[key] / rate['memcpy']:8.1%}"
        )
    worst = min(rate["stream_load"], rate["stream_store"]) / rate["socket"]
    verdict = "met" if worst >= TARGET else "missed"
    print(f"target: stream load and store >= {TARGET:.0%} of the socket: {verdict} ({worst:.0%})")
    for key, share in SAME_HOST_TARGETS.items():
        got = rate[key] / rate["memcpy"]
        verdict = "met" if got >= share else "missed"
        print(f"target: {key} >= {share:.0%} of memcpy: {verdict} ({got:.0%})")
    keys = ["memcpy", "socket", "stream_load", "stream_store", "rest_get", "rest_put"]
    out: dict[str, float | None] = {k: round(rate[k], 3) for k in keys}
    out.update(redis_get=round(rate["redis_get"], 3), redis_set=round(rate["redis_set"], 3))
    out.update(
        same_host_load=round(rate["same_host_load"], 3),
        same_host_store=round(rate["same_host_store"], 3),
    )
    return out


if __name__ == "__main__":
    main()
