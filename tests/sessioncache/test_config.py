"""README.md's configuration table is the one rendered from ``Settings``."""

from __future__ import annotations

from pathlib import Path

import pytest

from sessioncache.config import (
    Settings,
    main,
    readme_table,
    settings_table,
    with_table,
)

README = Path(__file__).parents[2] / "README.md"


def test_readme_table_is_the_rendered_one():
    assert readme_table(README.read_text()) == settings_table(), (
        "README.md's configuration table is out of date: "
        "run `python -m sessioncache.config --write README.md`"
    )


def test_every_setting_has_a_row_and_a_description():
    table = settings_table()
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} has no description"
        assert f"| `SESSIONCACHE_{name.upper()}` |" in table


def test_defaults_render_readably(monkeypatch: pytest.MonkeyPatch):
    rows = {
        line.split(" | ")[0].strip("| `"): line.split(" | ")[1]
        for line in settings_table().splitlines()[2:]
    }
    assert rows["SESSIONCACHE_CPU_BYTES"] == "`4294967296` (4 GiB)"
    assert rows["SESSIONCACHE_MAX_BODY_BYTES"] == "`268435456` (256 MiB)"
    assert rows["SESSIONCACHE_CHAT_TTL_S"] == "`604800` (7 days)"
    assert rows["SESSIONCACHE_MAX_LEASE_S"] == "`3600`"
    assert rows["SESSIONCACHE_PROMOTE_ON_GET"] == "`true`"
    assert rows["SESSIONCACHE_API_KEYS"] == "`{}`"
    assert rows["SESSIONCACHE_DATABASE_SCHEMA"] == "none"
    assert rows["SESSIONCACHE_REDIS_WRITE_POLICY"] == "`write_through`"
    # a default_factory that depends on the machine renders as what it means
    monkeypatch.setattr("socket.gethostname", lambda: "some-host")
    assert rows["SESSIONCACHE_NODE_ID"] == "the host name"
    assert "some-host" not in settings_table()


def test_write_replaces_only_the_table(tmp_path: Path):
    text = README.read_text()
    stale = text.replace("| `SESSIONCACHE_PORT` |", "| `SESSIONCACHE_PORT_OLD` |")
    assert stale != text
    path = tmp_path / "README.md"
    path.write_text(stale)
    assert main(["--write", str(path)]) == 0
    assert path.read_text() == text
    assert with_table(text) == text


def test_markdown_prints_the_table(capsys: pytest.CaptureFixture[str]):
    assert main(["--markdown"]) == 0
    assert capsys.readouterr().out == settings_table()


def test_missing_markers_are_an_error():
    with pytest.raises(ValueError, match="settings table"):
        readme_table("# no table here\n")


def test_the_same_host_socket_is_advertised_absolute(tmp_path, monkeypatch):
    # `sessioncache serve` on its defaults keeps its data in ./.sessioncache: a client in
    # another directory must still find the socket the node advertises
    monkeypatch.chdir(tmp_path)
    path = Settings().shm_socket_path()
    assert path.is_absolute()
    assert path == tmp_path.absolute() / ".sessioncache" / "sessioncache.sock"
