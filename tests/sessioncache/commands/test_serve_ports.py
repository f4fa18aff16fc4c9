"""``sessioncache serve --port P`` puts the block stream on P + 1 (a second node on one host
never collides with the first's stream), unless told otherwise."""

from __future__ import annotations

import argparse

from sessioncache.commands.serve import register, stream_port_for


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_the_stream_port_follows_the_port_unless_set() -> None:
    assert stream_port_for(parse(), {}) is None  # the settings' own (8081)
    assert stream_port_for(parse("--port", "9100"), {}) == 9101
    assert stream_port_for(parse("--port", "9100", "--stream-port", "9300"), {}) == 9300
    env = {"SESSIONCACHE_STREAM_PORT": "9500"}
    assert stream_port_for(parse("--port", "9100"), env) is None  # the environment wins
    assert stream_port_for(parse("--port", "0"), {}) == 0  # a free one for a free one
