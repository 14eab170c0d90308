"""An authenticated, typed, two-way message pipe between two processes over ZeroMQ.

Each end *binds* a PULL socket for what it receives and *connects* a PUSH socket to the
other end's PULL. Only receiving sockets are ever bound, so a stranger who reaches an
endpoint can only send into it — it can never connect as a reader and siphon off messages
meant for the real peer (which a bound PUSH would hand out round-robin).

Authentication: every message travels as one frame, ``mac + payload``, where ``mac`` is the
HMAC-SHA256 of the payload under a key derived from the shared secret and the *receiving*
endpoint's address, checked with ``hmac.compare_digest`` before anything is decoded. (One
frame, not two: a send interrupted by a signal can never leave half a message queued.) A
message without a valid MAC is dropped and counted (``rejected``), and the channel keeps
working. Why a MAC on every frame rather than a first-frame handshake per connection:
PUSH/PULL does not tell the receiver which connection a message came from, so a handshake
would authenticate nobody; ZeroMQ's CURVE/ZAP would, at the cost of a keypair per
endpoint and a ZAP handler thread, to protect a link that never leaves the host. The HMAC
costs a few microseconds per step-sized message (SHA-256 runs at hundreds of MB/s). Keys
differ per direction, so a message cannot be reflected back to its sender as if the peer
had sent it.
Replays are left to the protocol above (the executor's calls carry sequence numbers).

One end may talk to several peers (the engine core serves several API-server processes):
it receives from all of them on its one bound socket and sends to each through a socket of
its own, ``connect(address)`` giving the peer's index for ``send(msg, peer)``. Every sender
to an address shares that address's key, so the receiver knows a message came from a
holder of the secret, and the protocol's messages say which peer sent them.

Thread use: ``send`` may be called from one thread and ``recv``/``try_recv`` from another
(they use different sockets), but neither from two threads at once.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import time
from typing import Any, Optional, Sequence, TypeVar

from tandem.ipc.codec import decode, encode

__all__ = ["Channel"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_MAC_BYTES = hashlib.sha256().digest_size
_RECONNECT_MS = 20  # the peer binds its end a moment after we connect: retry quickly


def _direction_key(secret: bytes, receiving_address: str) -> bytes:
    return hmac.digest(secret, b"tandem-ipc/1 " + receiving_address.encode(), "sha256")


class Channel:
    """One end of a pipe: receives on ``local`` (bound here), sends to ``remote`` (the
    peer's ``local``; more peers with ``connect``). Both ends must name the two addresses
    identically and share ``secret``. ``max_message_bytes`` bounds what a stranger can make
    us buffer."""

    def __init__(self, ctx: Any, secret: bytes, local: str, remote: Optional[str | Sequence[str]] = None,
                 max_message_bytes: int = 1 << 30) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = ctx
        self._secret = secret
        self.local = local
        self._recv_key = _direction_key(secret, local)
        self._peers: list[tuple[Any, bytes]] = []  # (PUSH socket, key) per peer
        self.remotes: list[str] = []
        self.rejected = 0
        self._rx = ctx.socket(zmq.PULL)
        try:
            self._rx.setsockopt(zmq.LINGER, 0)
            self._rx.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            self._rx.bind(local)
            for address in [remote] if isinstance(remote, str) else (remote or []):
                self.connect(address)
        except BaseException:
            self.close()
            raise

    @property
    def remote(self) -> str:
        """The first peer's address."""
        return self.remotes[0]

    def connect(self, remote: str) -> int:
        """Add a peer (its ``local`` address); returns its index for ``send``."""
        zmq = self._zmq
        tx = self._ctx.socket(zmq.PUSH)
        try:
            tx.setsockopt(zmq.LINGER, 0)
            tx.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
            tx.connect(remote)
        except BaseException:
            tx.close(linger=0)
            raise
        self._peers.append((tx, _direction_key(self._secret, remote)))
        self.remotes.append(remote)
        return len(self._peers) - 1

    @property
    def socket(self) -> Any:
        """The receiving socket, to register with a ``zmq.Poller`` that watches several channels."""
        return self._rx

    def send(self, msg: Any, peer: int = 0) -> None:
        """Encode ``msg`` (see ``tandem.ipc.codec``) and queue it for the peer; never waits
        for the peer to be there (ZeroMQ queues until it connects). ``None`` is not a
        message: ``try_recv`` uses it to say "nothing waiting"."""
        if msg is None:
            raise ValueError("cannot send None as a message")
        self.send_encoded(encode(msg), peer)

    def send_encoded(self, payload: bytes, peer: int = 0, block: bool = True) -> bool:
        """Send a message already encoded with ``tandem.ipc.encode`` (to encode once for many
        peers). With ``block=False`` a message that the peer's full queue cannot take (the
        peer is gone or stuck) is dropped instead of waited on: returns False."""
        tx, key = self._peers[peer]
        frame = hmac.digest(key, payload, "sha256") + payload
        if block:
            tx.send(frame, copy=False)
            return True
        try:
            tx.send(frame, self._zmq.NOBLOCK, copy=False)
        except self._zmq.Again:
            return False
        return True

    def try_recv(self, tp: type[T] | Any = Any) -> Optional[T]:
        """The next authentic message decoded as ``tp``, or None if none is waiting.
        Forged messages in front of it are dropped."""
        zmq = self._zmq
        while True:
            try:
                frames = self._rx.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            payload = self.authentic(frames)
            if payload is not None:
                return decode(payload, tp)

    def recv(self, tp: type[T] | Any = Any, timeout_s: Optional[float] = None) -> T:
        """Wait for the next authentic message (forever, or raise ``TimeoutError``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            msg = self.try_recv(tp)
            if msg is not None:
                return msg
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._rx.poll(wait_ms) and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no message on {self.local} within {timeout_s:g} s")

    def authentic(self, frames: list[bytes]) -> Optional[memoryview]:
        """The payload of a received message (its frames, as the socket gave them) that
        carries a valid MAC, else None (and counted). For receivers that read the socket
        themselves, e.g. through asyncio."""
        if len(frames) == 1 and len(frames[0]) >= _MAC_BYTES:
            frame = memoryview(frames[0])
            payload = frame[_MAC_BYTES:]
            if hmac.compare_digest(frame[:_MAC_BYTES], hmac.digest(self._recv_key, payload, "sha256")):
                return payload
        self.rejected += 1
        # Loud once (someone is talking to our endpoint), then quiet: a flood must not fill logs.
        log = logger.warning if self.rejected == 1 else logger.debug
        log("dropped a message on %s that failed authentication (%d so far)", self.local, self.rejected)
        return None

    def close(self, linger_s: float = 0.0) -> None:
        """Close both sockets. ``linger_s`` lets queued outgoing messages flush (a last
        reply); 0 drops them, so closing never blocks. Idempotent."""
        self._rx.close(linger=0)
        for tx, _ in self._peers:
            tx.close(linger=int(linger_s * 1000))
