"""A child process for the ipc tests, started the way tandem starts its own children:
``python -m echo_child <dir>`` through ``tandem.ipc.start_child``. It answers each
``Ping`` with a ``Pong`` until told to stop, and removes the directory if its parent dies."""
from __future__ import annotations

import os
import sys

import msgspec
import zmq

from tandem.ipc import Channel, PrivateDir, exit_with_parent, read_secret


class Ping(msgspec.Struct):
    n: int
    stop: bool = False


class Pong(msgspec.Struct):
    n: int
    pid: int
    rejected: int


def main(argv: list[str]) -> None:
    secret = read_secret()
    where = PrivateDir(argv[0])
    exit_with_parent(cleanup=where.remove)
    ctx = zmq.Context()
    chan = Channel(ctx, secret, local=where.address("down"), remote=where.address("up"))
    try:
        while True:
            ping = chan.recv(Ping)
            chan.send(Pong(ping.n, os.getpid(), chan.rejected))
            if ping.stop:
                return
    finally:
        chan.close(linger_s=5)
        ctx.term()


if __name__ == "__main__":
    main(sys.argv[1:])
