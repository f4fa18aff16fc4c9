"""A data-plane client that stops in the middle of a transfer, to be killed there with
``kill -9`` by tests/sessioncache/dataplane/test_kill.py. It speaks the frames over a plain
socket (the codec, no ``StreamClient``), so it can stop anywhere in a frame.

    python killed_client.py load  ADDRESS SEED BLOCKS
        leases the chain of SEED's tokens, asks for all of it, reads one block, then stalls
    python killed_client.py store ADDRESS SEED BLOCKS LEASE_SEED LEASE_BLOCKS SENT
        leases the chain of LEASE_SEED's tokens (held by the node), then stores the chain of
        SEED's tokens: sends SENT whole payloads and half of the next, then stalls

Prints ``stalled`` once it stalls; payloads are ``conftest.pattern`` of each id.
"""

from __future__ import annotations

import socket
import sys
import time

import numpy as np

from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import HEADER_SIZE, Op
from sessioncache.hashing import block_hashes_from_bytes, tokens_to_le_bytes
from tests.sessioncache.dataplane.conftest import BLOCK, NS, pattern, tokens


def read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def call(sock: socket.socket, frame: bytes, expect: Op) -> bytes:
    sock.sendall(frame)
    header = frames.decode_header(read_exactly(sock, HEADER_SIZE), requests=False)
    body = read_exactly(sock, header.body_len)
    if header.opcode != expect:
        raise RuntimeError(f"{header.opcode.name}: {body!r}")
    return body


def lease(sock: socket.socket, root: bytes, seed: int, blocks: int) -> tuple[bytes, list[bytes]]:
    ids = block_hashes_from_bytes(root, tokens_to_le_bytes(tokens(seed, blocks)), 4)
    ok = frames.decode_lookup_ok(
        call(sock, frames.encode_lookup(3, frames.Lookup(root, ids, 600_000)), Op.LOOKUP_OK)
    )
    if ok.lease is None or len(ok.nbytes) != blocks:
        raise RuntimeError(f"{len(ok.nbytes)} of {blocks} blocks held")
    return ok.lease, list(ids)


def main() -> None:
    mode, address, seed, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    call(sock, frames.encode_hello(1, frames.Hello(None, "killed")), Op.HELLO_OK)
    root = call(sock, frames.encode_resolve(2, NS), Op.RESOLVE_OK)
    if mode == "load":
        key, _ = lease(sock, root, seed, blocks)
        sock.sendall(frames.encode_load(4, frames.LoadLease(key, 0, blocks)))
        read_exactly(sock, HEADER_SIZE + BLOCK)  # one block, then the node waits on us
    else:
        lease(sock, root, int(sys.argv[5]), int(sys.argv[6]))
        sent = int(sys.argv[7])
        toks = tokens(seed, blocks)
        ids = block_hashes_from_bytes(root, tokens_to_le_bytes(toks), 4)
        head = frames.StoreHead(root, None, 4, blocks, BLOCK)
        sock.sendall(frames.encode_store_head(5, head, tokens_to_le_bytes(toks)))
        for block_id in ids[:sent]:
            sock.sendall(pattern(block_id))
        sock.sendall(np.asarray(pattern(ids[sent]))[: BLOCK // 2])
    print("stalled", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
