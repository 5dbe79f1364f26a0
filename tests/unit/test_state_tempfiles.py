"""state.py writes keys and the logging config through unique temp files (issue 14): two
concurrent `serve` runs must not share one `api-key.tmp`, and a planted temp name must not be
written through."""

import os
import stat

from flash_cli import state


def test_concurrent_key_writers_do_not_share_a_temp_file(monkeypatch):
    real_link = os.link
    nested = []

    def racing_link(src, dst):
        # While the first serve is between "temp written" and "published", a second serve
        # (another instance name) writes its own key: the classic interleaving of two runs.
        if not nested:
            nested.append(None)
            nested[0] = state.ensure_api_key("other")
        return real_link(src, dst)

    monkeypatch.setattr(state.os, "link", racing_link)
    path, created = state.ensure_api_key("first")
    assert created and nested[0][1]
    first, other = path.read_text().strip(), nested[0][0].read_text().strip()
    assert first.startswith("sk-flash-") and other.startswith("sk-flash-") and first != other
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(nested[0][0].stat().st_mode) == 0o600
    assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_planted_temp_name_is_not_written_through(tmp_path):
    d = state.state_dir()
    d.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    (d / "api-key.tmp").symlink_to(victim)
    (d / "logging.tmp").symlink_to(victim)
    path, _ = state.ensure_api_key("default")
    state.ensure_logging_config()
    assert victim.read_text() == "untouched\n"
    assert path.read_text().startswith("sk-flash-") and not path.is_symlink()


def test_logging_config_written_atomically_and_readable():
    path = state.ensure_logging_config()
    assert '"vllm.entrypoints.logger"' in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
