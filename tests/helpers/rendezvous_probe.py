"""Records how a run met its process group: its store and the ports it listens on (test-only shim).

A one-process ``launch/train.py`` started without a launcher needs no port: a port picked by binding
port 0 and closing it, then listened on by a ``TCPStore`` seconds later, can be taken by another
process's connection in between (``EADDRINUSE``). This shim, placed before the next script, records

- the port of every IPv4/IPv6 ``socket.bind`` made from Python (``bound``; libraries bind too, e.g.
  urllib3 probes IPv6 with ``::1`` port 0 and never listens there),
- when the run destroys its process group: the default group's store, unwrapped from its
  ``PrefixStore`` layers (``TCPStore`` listens on a port; ``HashStore`` lives in the process), and
  the TCP ports this process then listens on (``listening``, from ``/proc/net/tcp*``; gloo listens
  on ports the kernel hands it at ``listen``, never picked ahead),

and writes ``{"bound": [...], "stores": [[...]], "listening": [[...]]}`` to ``NTL_RENDEZVOUS_REPORT``
at exit. A port both in ``bound`` and in ``listening`` was picked ahead of its use:

    python tests/helpers/rendezvous_probe.py tests/helpers/ds_launch.py launch/train.py key=value ...
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import socket
import sys
from typing import Any

# This file's folder holds tests/helpers/tokenizers.py, which must not shadow the real package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch.distributed as dist  # noqa: E402

REPORT: dict[str, list] = {"bound": [], "stores": [], "listening": []}
_bind = socket.socket.bind


def recording_bind(self: socket.socket, address: Any) -> None:
    _bind(self, address)
    if self.family in (socket.AF_INET, socket.AF_INET6):
        REPORT["bound"].append(self.getsockname()[1])


def listening_ports() -> list[int]:
    """The TCP ports this process listens on (Linux: its socket inodes in ``/proc/net/tcp``, ``tcp6``)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as f:
            rows = f.read().splitlines()[1:]
        for line in rows:
            fields = line.split()  # sl local_address rem_address st ... inode
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


_destroy = dist.destroy_process_group


def recording_destroy(*args: Any, **kwargs: Any) -> None:
    if dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        chain = [type(store).__name__]
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
            chain.append(type(store).__name__)
        REPORT["stores"].append(chain)
        REPORT["listening"].append(listening_ports())
    _destroy(*args, **kwargs)


def write_report() -> None:
    with open(os.environ["NTL_RENDEZVOUS_REPORT"], "w", encoding="utf-8") as f:
        json.dump(REPORT, f)


if __name__ == "__main__":
    socket.socket.bind = recording_bind  # type: ignore[method-assign,assignment]
    dist.destroy_process_group = recording_destroy
    atexit.register(write_report)
    arguments = sys.argv[1:]
    script = arguments.pop(0)
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")
