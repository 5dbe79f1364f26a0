"""NODES (issue 34): every malformed form is a usage error (exit 2) naming the entry and the
accepted forms, from any command, before an engine is dialled; the good forms become the engine
URLs docker-py dials (its own URL parser must accept each of them)."""

from __future__ import annotations

import pytest

from flash_cli import nodes
from flash_cli.__main__ import main
from flash_cli.errors import ConfigError
from flash_cli.settings import resolve

ACCEPTED_SHOWN = "NODES accepts localhost, host, user@host, host:port"


@pytest.mark.parametrize("written,url,scheme", [
    ("localhost", "", "local"),
    ("local", "", "local"),
    ("spark2", "ssh://spark2", "ssh"),
    ("me@spark2", "ssh://me@spark2", "ssh"),
    ("me@10.0.0.2:2222", "ssh://me@10.0.0.2:2222", "ssh"),
    ("ssh://me@spark2:22", "ssh://me@spark2:22", "ssh"),
    ("tcp://10.0.0.2:2375", "tcp://10.0.0.2:2375", "tcp"),
    ("unix:///run/d2.sock", "unix:///run/d2.sock", "unix"),
])
def test_good_forms(written, url, scheme):
    (box,) = nodes.parse(written)
    assert (box.written, box.url, box.scheme) == (written, url, scheme)
    assert box.plaintext == (scheme == "tcp")


def test_docker_py_accepts_every_url_we_produce():
    from docker.utils import parse_host

    for written in ("spark2", "me@spark2", "me@10.0.0.2:2222", "ssh://me@spark2:22", "tcp://10.0.0.2:2375",
                    "unix:///run/d2.sock"):
        assert parse_host(nodes.parse_one(written).url)  # raises DockerException / ValueError otherwise


@pytest.mark.parametrize("value,needle", [
    ("h:1:2,localhost", "'h:1:2' has more than one ':'"),  # the repro: was an uncaught ValueError
    ("a,,b", "empty entry (position 2)"),
    (",a,b", "empty entry (position 1)"),
    ("a,b,", "empty entry (position 3)"),
    ("user@,b", "'user@' has an empty host"),
    ("@h,b", "'@h' has an empty user"),
    (":22,b", "':22' has an empty host"),
    ("a:,b", "'a:' has an empty port"),
    ("http://h:2375,b", "'http://h:2375' uses http://"),
    ("https://h:2376,b", "'https://h:2376' uses https://"),
    ("ftp://h,b", "unknown scheme 'ftp'"),
    ("a:0,b", "port 0, outside 1-65535"),
    ("a:65536,b", "port 65536, outside 1-65535"),
    ("a:22x,b", "port '22x', which is not a number"),
    ("ssh://h:99999,b", "port 99999"),
    ("tcp://h,b", "'tcp://h' needs a port"),
    ("tcp://u@h:2375,b", "names a user, which only ssh:// takes"),
    ("ssh://h/x,b", "has a path after the host"),
    ("unix://,b", "needs an absolute socket path"),
    ("unix://rel.sock,b", "needs an absolute socket path"),
    ("-oProxyCommand=x,b", "has the host '-oProxyCommand=x'"),
    ("-l@h,b", "has the user '-l'"),
    ("a/b,c", "a '/' without a scheme"),
    ("a,a", "names the same box twice ('a' and 'a')"),
    ("a,ssh://a", "names the same box twice ('a' and 'ssh://a')"),
])
def test_malformed_forms_exit_2_naming_the_entry(value, needle, capsys):
    with pytest.raises(ConfigError) as err:
        resolve(overrides={"NODES": value})
    assert needle in str(err.value) and err.value.hint
    # through the CLI: `flash status` (the command) and a multi-node dry run, exit 2, no traceback
    for argv in (["status", f"NODES={value}"], ["serve", "tp2", f"NODES={value}", "NODE_ADDRS=10.0.0.1,10.0.0.2",
                                                 "--dry-run"]):
        assert main(argv) == 2, argv
        e = capsys.readouterr().err
        assert needle in e and "hint:" in e and "Traceback" not in e, e


def test_hint_names_the_accepted_forms():
    with pytest.raises(ConfigError) as err:
        nodes.parse("h:1:2,localhost")
    assert err.value.hint.startswith(ACCEPTED_SHOWN) and "tcp://host:port" in err.value.hint


def test_localhost_twice_is_the_one_host_case():
    assert [b.url for b in nodes.parse("localhost,localhost")] == ["", ""]
    assert nodes.parse("") == [] and nodes.parse(None) == []


def test_the_cli_extra_brings_docker_py_ssh_transport():
    """The issue's repro: `flash status NODES=boxa,localhost` said "Install paramiko package to enable
    ssh:// support": docker-py defines its ssh adapter only when paramiko imports, even for
    use_ssh_client=True (the ssh binary), which is how flash dials a box (deploy.connect)."""
    import docker
    from docker.transport import SSHHTTPAdapter  # noqa: F401 - ImportError without paramiko

    # version given: no connection is tried, only the transport is built
    client = docker.DockerClient(base_url="ssh://nobody@127.0.0.1:1", use_ssh_client=True, timeout=1, version="1.41")
    assert type(client.api._custom_adapter).__name__ == "SSHHTTPAdapter"
    client.close()
