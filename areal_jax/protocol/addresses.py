"""Rollout server addresses: checked as config values, and kept in an addresses file (one
address per line; blank lines and ``#`` comments ignored) that servers write themselves into
(``register_file``) and trainers follow (``rollout.addresses_file``)."""

from __future__ import annotations

import fcntl
import os
import re
import stat
from pathlib import Path

# HOST:PORT (a name, an IPv4 address or a bracketed IPv6 one), or a gRPC target with one of
# gRPC's schemes (dns:///host:port, unix:/path, ...).
_HOST_PORT = re.compile(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Za-z:.%]+\]):(\d{1,5})")
_SCHEME = re.compile(r"(?:dns|unix|unix-abstract|ipv4|ipv6|vsock|xds):\S+")
MAX_FILE_BYTES = 1 << 20  # a list of addresses, not a data file


def check_address(text: str, where: str) -> str:
    """``text`` if it is a server address (``HOST:PORT`` with a port in 1..65535, or a gRPC
    target with one of gRPC's schemes, such as ``unix:/path``); else ``ValueError`` naming
    ``where``."""
    match = _HOST_PORT.fullmatch(text)
    if match is not None and 1 <= int(match.group(1)) <= 65535:
        return text
    if match is None and _SCHEME.fullmatch(text):
        return text
    raise ValueError(f"{where}: {text!r} is not a rollout server address (HOST:PORT)")


def read_addresses_file(path: Path) -> list[str]:
    """The addresses ``path`` lists, in order, each once; ``ValueError`` naming the file and
    line of one that is not an address, ``OSError`` when it cannot be read."""
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{path}: over {MAX_FILE_BYTES >> 20} MiB; it should list addresses")
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    listed: dict[str, None] = {}
    for number, line in enumerate(text.splitlines(), 1):
        entry = _entry(line)
        if entry:
            listed[check_address(entry, f"{path}, line {number}")] = None
    return list(listed)


def register_address(path: Path, address: str) -> None:
    """List ``address`` in the addresses file ``path`` (made if absent; other lines kept): a
    server announcing itself to the trainers that follow the file."""
    _rewrite(path, lambda lines: lines if address in map(_entry, lines) else [*lines, address])


def unregister_address(path: Path, address: str) -> None:
    """Remove the lines listing ``address`` from the addresses file ``path``, if any."""
    _rewrite(path, lambda lines: [line for line in lines if _entry(line) != address])


def _entry(line: str) -> str:
    return line.split("#", 1)[0].strip()


def _rewrite(path: Path, change) -> None:
    """Replace ``path``'s lines with ``change(lines)``, whole (written aside, then renamed into
    place, so a reader never sees half of it), under a lock shared by every writer (servers
    starting and stopping at once on a shared filesystem). The file keeps its permissions."""
    path = Path(path)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            lines = path.read_text().splitlines() if path.exists() else []
            changed = change(lines)
            if changed == lines:
                return
            aside = path.with_name(f".{path.name}.{os.getpid()}")
            try:
                aside.write_text("".join(f"{line}\n" for line in changed))
                if path.exists():  # readable by whom it was (a trainer running as another user)
                    os.chmod(aside, stat.S_IMODE(path.stat().st_mode))
                os.replace(aside, path)
            except BaseException:
                aside.unlink(missing_ok=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
