"""A same-host client that stops in the middle of a transfer, to be killed there with
``kill -9`` by tests/sessioncache/dataplane/test_samehost_kill.py.

    python samehost_client.py load  SOCKET SEED BLOCKS
        stores the chain of SEED's tokens, locates it with a long lease, copies half of it
        out of shared memory, then stalls (holding the lease)
    python samehost_client.py stage SOCKET SEED BLOCKS
        stages the chain of SEED's tokens (slots reserved), fills half of the slots, commits
        nothing, then stalls

Prints ``stalled`` once it stalls; payloads are ``conftest.pattern`` of each id.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import Op, StoreHead
from sessioncache.dataplane.samehost import SameHostClient
from sessioncache.hashing import tokens_to_le_bytes
from tests.sessioncache.dataplane.conftest import BLOCK, NS, pattern, tokens


def main() -> None:
    mode, path, seed, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    client = SameHostClient.connect(path)
    root = client.resolve(NS)
    toks = tokens(seed, blocks)
    ids = client.block_hashes(root, toks)
    if mode == "load":
        ack = client.store(root, toks, [pattern(h) for h in ids])
        assert ack.stored + ack.tally("present") == blocks, ack
        found = client.locate(root, ids, lease_ms=600_000)
        assert found.located == blocks
        out = np.empty((blocks, BLOCK), np.uint8)
        for i in range(blocks // 2):
            np.copyto(out[i], client._segment(found.slots[i]))
    else:
        head = StoreHead(root, None, NS.block_tokens, blocks, BLOCK)
        body = client._call(
            Op.STAGE, lambda rid: frames.encode_stage(rid, head, tokens_to_le_bytes(toks))
        )
        staged = frames.decode_stage_ok(body, BLOCK)
        assert staged.status == [frames.STORED] * blocks, staged.status
        client._ensure_segments(s.segment for s in staged.slots if s is not None)
        for block_id, slot in list(zip(ids, staged.slots, strict=True))[: blocks // 2]:
            assert slot is not None
            np.copyto(client._segment(slot), pattern(block_id))
    print("stalled", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
