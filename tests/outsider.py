"""What an outsider can do to tandem's IPC endpoints: connect like any local process of the
same user would and push raw frames (the security tests of tandem.ipc and the executors)."""
from __future__ import annotations

import zmq


def send_as_outsider(address: str, frames: list[bytes]) -> None:
    """Connect to ``address`` from a fresh ZeroMQ context and send ``frames`` as one message."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.connect(address)
    s.send_multipart(frames)
    s.close(linger=2000)
    ctx.term()
