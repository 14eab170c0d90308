"""tandem's process boundary: typed messages over private, authenticated local channels.

Every process tandem starts (multiproc workers, the engine-core process, the API-server
processes of ``tandem serve --api-server-count N``) talks to the others through this
package and nothing else. Three promises:

* **nothing is unpickled**: messages are msgpack, decoded into declared types only
  (``codec``); a forged or corrupt message can fail to decode, never run code;
* **nobody else gets in**: endpoints are socket files in a ``0700`` directory (other users
  cannot reach them) and every message carries an HMAC under a per-engine secret (other
  processes of the same user cannot forge one) — ``endpoints``, ``channel``;
* **children never re-run the user's program and never outlive the parent**: they are
  started as ``python -m <tandem module>``, get the secret on stdin, and exit when stdin
  reaches EOF (``child``).

API (imports nothing of tandem but this package and ``tandem.config``; ``zmq`` and ``msgspec`` are the only
third-party dependencies; torch only to send or receive a tensor, transformers only for a
``WireModelConfig``, pydantic only when such models are sent):

* ``encode(obj) -> bytes`` / ``decode(data, T) -> T``: the codec (dataclasses, msgspec
  structs, pydantic models, tensors as raw buffers; see ``codec``);
  ``WireModelConfig.from_config(mc)`` / ``.to_config()``: a ``ModelConfig`` on the wire.
* ``new_secret() -> bytes``; ``PrivateDir.create()`` -> a private directory,
  ``.address(name)`` -> ``"ipc://<dir>/<name>"``, ``.remove()``; ``PrivateDir(path)``
  re-opens one whose path a child got on argv.
* ``Channel(ctx, secret, local, remote)``: one end of a two-way pipe; ``send(msg, peer=0)``,
  ``recv(T, timeout_s=None)``, ``try_recv(T)``, ``.socket`` (for a ``zmq.Poller`` or an
  asyncio twin: ``authentic(frames)`` checks what was read), ``connect(address)`` (another
  peer: the engine core serves several front ends on one channel), ``rejected`` (forged
  messages dropped), ``close(linger_s=0)``.
* ``start_child(module, args, secret, stdout=2) -> Popen`` (parent side);
  ``read_secret()`` and ``exit_with_parent(cleanup)`` (child side).

A typed request/reply pipe to a child process::

    # parent
    import zmq
    from tandem import ipc

    secret, where = ipc.new_secret(), ipc.PrivateDir.create()
    ctx = zmq.Context()
    chan = ipc.Channel(ctx, secret, local=where.address("up"), remote=where.address("down"))
    proc = ipc.start_child("mypkg.child_main", [where.path], secret, stdout=2)
    chan.send(Hello(name="core"))                 # any msgspec.Struct / dataclass
    reply = chan.recv(Welcome, timeout_s=60)      # decoded into Welcome, or an error
    ...
    proc.stdin.close(); proc.wait()               # EOF on stdin: the child exits
    chan.close(); ctx.term(); where.remove()

    # child: mypkg/child_main.py, run as ``python -m mypkg.child_main <dir>``
    secret = ipc.read_secret()                    # first thing: the secret from stdin
    where = ipc.PrivateDir(sys.argv[1])
    ipc.exit_with_parent(cleanup=where.remove)    # parent gone -> remove the dir, exit
    chan = ipc.Channel(zmq.Context(), secret, local=where.address("down"), remote=where.address("up"))
    hello = chan.recv(Hello)
    chan.send(Welcome(...))

Each side binds only the socket it receives on; the two ends name the same two addresses
crosswise. Which messages may follow which is the protocol's business (e.g. the worker
RPC in ``tandem/worker/worker_process.py``): give every message an explicit type and decode
with it.
"""
from tandem.ipc.channel import Channel
from tandem.ipc.child import exit_with_parent, read_secret, start_child
from tandem.ipc.codec import DecodeError, decode, encode
from tandem.ipc.configs import WireModelConfig
from tandem.ipc.endpoints import PrivateDir, new_secret, runtime_base

__all__ = ["Channel", "DecodeError", "PrivateDir", "decode", "encode", "exit_with_parent", "new_secret",
           "read_secret", "runtime_base", "start_child", "WireModelConfig"]
