"""Private endpoints and authenticated channels: other users cannot reach an endpoint,
processes without the secret cannot inject a message, children never outlive their parent."""
from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from echo_child import Ping, Pong  # noqa: E402
from outsider import send_as_outsider  # noqa: E402
from proc_utils import pid_alive, wait_gone  # noqa: E402
from tandem.ipc import Channel, PrivateDir, encode, new_secret, start_child  # noqa: E402

HERE = Path(__file__).resolve().parent


class Note(msgspec.Struct):
    text: str


@pytest.fixture
def pair():
    """Two ends of one channel in this process, plus the directory they live in."""
    where, secret, ctx = PrivateDir.create(), new_secret(), zmq.Context()
    a = Channel(ctx, secret, local=where.address("a"), remote=where.address("b"))
    b = Channel(ctx, secret, local=where.address("b"), remote=where.address("a"))
    yield where, a, b
    a.close()
    b.close()
    ctx.term()
    where.remove()


@pytest.mark.timeout(30)
def test_private_dir_is_0700_and_removed():
    where = PrivateDir.create()
    assert stat.S_IMODE(os.stat(where.path).st_mode) == 0o700
    assert os.stat(where.path).st_uid == os.getuid()
    assert where.address("x") == f"ipc://{where.path}/x"
    with pytest.raises(ValueError):
        where.address("../escape")
    where.remove()
    where.remove()  # idempotent
    assert not os.path.exists(where.path)


@pytest.mark.timeout(30)
def test_typed_messages_both_ways(pair):
    _, a, b = pair
    a.send(Note("hello"))
    assert b.recv(Note, timeout_s=5) == Note("hello")
    b.send(Note("back"))
    assert a.recv(Note, timeout_s=5) == Note("back")
    assert a.try_recv(Note) is None
    with pytest.raises(TimeoutError):
        a.recv(Note, timeout_s=0.1)


@pytest.mark.timeout(30)
def test_a_process_without_the_secret_cannot_inject_a_message(pair):
    """Same user, right address: forged, unsigned, pickled and reflected messages are all
    dropped before decoding, and the channel keeps working."""
    _, a, b = pair
    forged = encode(Note("forged"))
    evil = pickle.dumps(Note)  # never reaches a decoder, let alone pickle
    send_as_outsider(b.local, [b"\0" * 32 + forged])  # wrong MAC
    send_as_outsider(b.local, [forged])  # no MAC
    send_as_outsider(b.local, [b"x" * 32 + evil])
    send_as_outsider(b.local, [b"a" * 40, b"b", b"c"])
    b.send(Note("mine"))  # a valid message for the *other* direction, reflected back at b:
    frames = a._rx.recv_multipart()  # noqa: SLF001  (take it off the wire as an attacker would)
    send_as_outsider(b.local, frames)
    deadline = time.monotonic() + 5
    while b.rejected < 5 and time.monotonic() < deadline:
        assert b.try_recv(Note) is None
        time.sleep(0.02)
    assert b.rejected == 5
    a.send(Note("genuine"))
    assert b.recv(Note, timeout_s=5) == Note("genuine")


@pytest.mark.timeout(30)
def test_other_users_cannot_reach_the_endpoint(pair):
    """The kernel refuses another user at the 0700 directory, before ZeroMQ sees anything."""
    where, a, b = pair
    path = b.local.removeprefix("ipc://")
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(where.path).st_mode) == 0o700
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user; the 0700 mode is checked above")
    probe = textwrap.dedent(f"""
        import os, socket
        os.setgid(65534); os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect({path!r})
            print("connected")
        except PermissionError:
            print("denied")
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=20)
    assert out.stdout.strip() == "denied", out.stderr
    me = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # while the owner gets through
    me.connect(path)
    me.close()


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


@pytest.mark.timeout(60)
def test_child_gets_the_secret_on_stdin_and_answers_typed_messages():
    where, secret, ctx = PrivateDir.create(), new_secret(), zmq.Context()
    chan = Channel(ctx, secret, local=where.address("up"), remote=where.address("down"))
    proc = start_child("echo_child", [where.path], secret, env=_child_env())
    try:
        chan.send(Ping(1))
        pong = chan.recv(Pong, timeout_s=30)
        assert pong == Pong(1, proc.pid, 0)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert secret not in cmdline and secret.hex().encode() not in cmdline
        assert secret not in environ and secret.hex().encode() not in environ
        assert b"-m\0echo_child\0" + where.path.encode() in cmdline
        chan.send(Ping(2, stop=True))
        assert chan.recv(Pong, timeout_s=30).n == 2
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdin.close()
        chan.close()
        ctx.term()
        where.remove()


_PARENT = textwrap.dedent("""
    import json, sys, zmq
    from tandem.ipc import Channel, PrivateDir, new_secret, start_child
    from echo_child import Ping, Pong
    where, secret = PrivateDir.create(), new_secret()
    chan = Channel(zmq.Context(), secret, local=where.address("up"), remote=where.address("down"))
    proc = start_child("echo_child", [where.path], secret)
    chan.send(Ping(1))
    chan.recv(Pong, timeout_s=60)
    print(json.dumps({"child": proc.pid, "dir": where.path}), flush=True)
    sys.stdin.read()
""")


@pytest.mark.timeout(90)
def test_a_killed_parent_leaves_no_child_and_no_directory():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=_child_env())
    try:
        info = json.loads(parent.stdout.readline())
        assert pid_alive(info["child"]) and os.path.isdir(info["dir"])
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert wait_gone([info["child"]], timeout=15) == [], "the child outlived its killed parent"
        deadline = time.monotonic() + 5
        while os.path.exists(info["dir"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(info["dir"]), "the endpoint directory outlived the killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()
        parent.stdin.close()
        parent.stdout.close()


@pytest.mark.timeout(30)
def test_one_end_serves_several_peers_and_drops_for_a_stuck_one():
    """The engine core's side: one bound socket receives from every front end, and each
    front end gets its own messages; a send that a gone peer's full queue cannot take is
    dropped (block=False) instead of stalling the sender."""
    where, secret, ctx = PrivateDir.create(), new_secret(), zmq.Context()
    hub = Channel(ctx, secret, local=where.address("hub"))
    fronts = [Channel(ctx, secret, local=where.address(f"f{i}"), remote=where.address("hub")) for i in range(2)]
    try:
        peers = [hub.connect(where.address(f"f{i}")) for i in range(2)]
        for i, f in enumerate(fronts):
            f.send(Note(f"from {i}"))
        got = sorted(hub.recv(Note, timeout_s=5).text for _ in range(2))
        assert got == ["from 0", "from 1"]
        for i in (1, 0):
            hub.send(Note(f"to {i}"), peer=peers[i])
        assert [f.recv(Note, timeout_s=5).text for f in fronts] == ["to 0", "to 1"]
        assert hub.remotes == [where.address("f0"), where.address("f1")]
        gone = hub.connect(where.address("nobody"))  # never bound: the queue fills, then sends drop
        sent = [hub.send_encoded(encode(Note("x")), gone, block=False) for _ in range(5000)]
        assert sent[0] and not sent[-1]
    finally:
        hub.close()
        for f in fronts:
            f.close()
        ctx.term()
        where.remove()
