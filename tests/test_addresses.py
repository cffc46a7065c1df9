"""Rollout server addresses: as config values and as lines of ``rollout.addresses_file``."""

import pytest

from areal_jax.config import ConfigError
from areal_jax.protocol.addresses import MAX_FILE_BYTES, check_address, read_addresses_file
from areal_jax.controller.rollout_pool import RolloutPool
from areal_jax.experiment import RolloutConfig


@pytest.mark.parametrize("address", ["localhost:50051", "10.0.0.7:1", "rollout-3.svc:65535",
                                     "[::1]:50051", "[fe80::1%eth0]:9", "dns:///rollout:50051",
                                     "unix:/tmp/rollout.sock", "xds:///rollout-svc"])
def test_server_addresses_are_accepted(address):
    assert check_address(address, "rollout.addresses[0]") == address


@pytest.mark.parametrize("address", ["rollout-0", "rollout-0:port", "host:0", "host:65536",
                                     "two words:1", "", ":50051", "http://host:1"])
def test_what_is_not_an_address_is_named_with_its_place(address):
    with pytest.raises(ValueError, match=r"^rollout.addresses\[2\]: '.*' is not a rollout "
                                         r"server address \(HOST:PORT\)$"):
        check_address(address, "rollout.addresses[2]")


def test_a_config_with_a_bad_address_is_refused_naming_the_entry():
    with pytest.raises(ConfigError, match=r"rollout.addresses\[1\]: 'b' is not a rollout"):
        RolloutConfig(addresses=["a:1", "b"])


def test_the_file_lists_addresses_in_order_once_without_comments(tmp_path):
    path = tmp_path / "servers.txt"
    path.write_text("# rollout nodes\n\nnode-1:50051  # the first\n  node-2:50051\nnode-1:50051\n")
    assert read_addresses_file(path) == ["node-1:50051", "node-2:50051"]
    path.write_text("node-1:50051\nnode-2\n")
    with pytest.raises(ValueError, match=rf"^{path}, line 2: 'node-2' is not a rollout server"):
        read_addresses_file(path)
    path.write_bytes(b"node-1:50051\n\xff\n")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        read_addresses_file(path)
    path.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="over 1 MiB"):
        read_addresses_file(path)


def test_a_pool_needs_a_readable_file_and_one_server(tmp_path):
    with pytest.raises(ValueError, match=r"^rollout.addresses_file: .*missing.txt: No such file"):
        RolloutPool([], addresses_file=tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("# none yet\n")
    with pytest.raises(ValueError, match="at least one rollout server is needed"):
        RolloutPool([], addresses_file=tmp_path / "empty.txt")
    (tmp_path / "one.txt").write_text("node-1:50051\nnode-0:50051\n")
    assert RolloutPool(["node-0:50051"], addresses_file=tmp_path / "one.txt").addresses == [
        "node-0:50051", "node-1:50051"]


def _register_many(path, first, count):
    from areal_jax.protocol.addresses import register_address

    for i in range(first, first + count):
        register_address(path, f"node-{i}:50051")


def test_servers_registering_at_once_are_all_listed_and_each_removes_only_itself(tmp_path):
    import multiprocessing

    from areal_jax.protocol.addresses import unregister_address

    path = tmp_path / "servers.txt"
    path.write_text("# this run's servers\nfixed:1  # by hand\n")
    workers = [multiprocessing.get_context("spawn").Process(
        target=_register_many, args=(path, 10 * w, 10)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    listed = read_addresses_file(path)
    assert listed[0] == "fixed:1" and sorted(listed[1:]) == sorted(
        f"node-{i}:50051" for i in range(40))
    _register_many(path, 5, 1)  # listed already: not twice
    unregister_address(path, "node-5:50051")
    unregister_address(path, "node-5:50051")
    unregister_address(tmp_path / "never-written.txt", "node-5:50051")
    assert not (tmp_path / "never-written.txt").exists()
    assert read_addresses_file(path) == [a for a in listed if a != "node-5:50051"]
    path.chmod(0o644)  # the trainer may run as another user: the rewritten file stays readable
    _register_many(path, 99, 1)
    assert path.stat().st_mode & 0o777 == 0o644
    assert path.read_text().startswith("# this run's servers\nfixed:1  # by hand\n")


def test_a_wildcard_server_lists_the_machines_name_not_localhost(tmp_path, monkeypatch, caplog):
    # Where the hosts file maps the machine's name to 127.0.0.1 (many images and containers)
    # getfqdn() answers "localhost": a server on 0.0.0.0 listed itself as localhost:PORT, and a
    # trainer on another host dialled its own loopback.
    import socket

    from rollout import server
    from rollout.config import ServerConfig

    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(socket, "gethostname", lambda: "rollout-7")
    resolved = {"rollout-7": "127.0.1.1", "node.example": "10.0.0.7"}
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (resolved[host], 0))])
    listed = tmp_path / "servers.txt"
    cfg = ServerConfig(engine={"model_path": "tiny"}, host="0.0.0.0", auth_token="t",
                       register_file=str(listed))
    with caplog.at_level("WARNING", logger="rollout.server"):
        assert server._register(cfg, 7) == "rollout-7:7"
        server._warn_if_listed_as_loopback(cfg, "rollout-7:7")
    assert listed.read_text().splitlines()[-1] == "rollout-7:7"
    assert "this machine's name, rollout-7, resolves to a loopback address here" in caplog.text
    assert "set advertise_address" in caplog.text
    caplog.clear()
    monkeypatch.setattr(socket, "gethostname", lambda: "node.example")
    with caplog.at_level("WARNING", logger="rollout.server"):
        assert server._register(cfg, 8) == "node.example:8"
        server._warn_if_listed_as_loopback(cfg, "node.example:8")
    assert "loopback" not in caplog.text


def test_a_server_advertises_where_it_can_be_reached():
    from rollout.config import ServerConfig

    def advertised(port=7, **fields):
        return ServerConfig(engine={"model_path": "tiny"}, **fields).advertised(port)

    assert advertised() == "127.0.0.1:7"
    assert advertised(host="::1", auth_token="t") == "[::1]:7"
    assert advertised(register_file="f", advertise_address="rollout-3.svc:443") == (
        "rollout-3.svc:443")
    with pytest.raises(ConfigError, match="advertise_address: 'rollout-3' is not a rollout"):
        advertised(register_file="f", advertise_address="rollout-3")
    with pytest.raises(ConfigError, match="advertise_address: set only with register_file"):
        advertised(advertise_address="rollout-3:1")
