"""One authenticated ZeroMQ control channel, used by every dpool process.

The coordinator's pool (a ROUTER to its workers), each worker (a DEALER to its
coordinator, and one to its daemon), the ``dpool-workers`` daemon (a ROUTER)
and the daemon's clients (a DEALER per request) all talk through
:class:`Channel`. It owns the parts that must be the same everywhere:

* socket options: ``LINGER`` 0 (closing never waits on undelivered
  messages) and ``MAXMSGSIZE`` (libzmq drops an oversized frame before we
  read it); on the coordinator's ROUTER also ``ROUTER_MANDATORY`` and
  ``SNDTIMEO``, so a send to a vanished or stalled peer is an error instead
  of a silent drop;
* the codec (:class:`dpool.protocol.Codec`: size, MAC, msgpack with limits,
  types, in that order);
* sequence numbers: every message sent carries the next one, and a message
  received must carry a higher one than the last from the same peer
  (replay and reordering protection, step 5 of the protocol's receive order);
  a reply also names the request it answers (``re``, see :mod:`dpool.protocol`);
* sends that an exception cut short (Ctrl-C lands between any two bytecodes):
  the number is taken before anything is sent, so a cut send skips one and
  never repeats one; and a ROUTER message is two frames (routing id, then the
  message), so a send cut between them is ended by the next send with an
  empty frame, which the peer drops unseen. Otherwise the next message would
  be glued to the cut one, and both peers would wait for messages never sent.

A frame that fails any check is never decoded further and never answered;
:attr:`Channel.rejected` counts them and ``on_reject`` reports them the way
the process reports things (a warning, a log line, stderr).
"""
from __future__ import annotations

import os
from typing import Callable

import zmq

from . import protocol as P
from .errors import ProtocolError

__all__ = ["Channel", "KEY_REJECTED"]

# What a daemon answers, once per connection, to a frame that failed authentication: a constant that says
# only that the key was wrong (it is not a message: it fails every check), so that the client can say so at
# once instead of timing out. Nothing else is ever answered to a frame that failed a check.
KEY_REJECTED = b"dpool: key rejected"

# libzmq's per-frame cap sits above the codec's payload limit by the MAC and the envelope.
_FRAME_SLACK = 1024
# pyzmq's constants are enums: ``zmq.SNDMORE | flags`` and ``recv_multipart``'s ``RCVMORE`` query run Python-level
# enum arithmetic (a few microseconds per message on the hot path); plain ints do not.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
# pyzmq's Python-level ``Socket.send``/``recv`` only add argument handling we never use (routing ids, groups,
# copy thresholds) around the Cython methods; calling those directly saves about a microsecond per frame.
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv


_CUT = [b""]


def _end_cut_message(sock: zmq.Socket) -> None:
    """End a ROUTER message of which only the routing frame was queued: an empty frame completes it, and
    the peer drops an empty message. If not even the routing frame was queued, a lone frame is no message
    and libzmq drops it (with or without ``ROUTER_MANDATORY``)."""
    try:
        _send(sock, b"", _NOBLOCK)
    except zmq.ZMQError:  # the peer is gone or full: the cut message goes with it
        pass


class Channel:
    """An authenticated ZeroMQ socket: typed messages in, typed messages out.

    Args:
        ctx: the process's ZeroMQ context.
        router: a ROUTER (one side, many peers, addressed by routing id) or a DEALER.
        key: the shared secret (see :class:`dpool.protocol.Codec`).
        max_bytes: largest message payload accepted.
        ident: a DEALER's routing id (how the ROUTER on the other side addresses it).
        send_timeout_ms: on a ROUTER, report unroutable peers and give up a blocked send
            after this long (``ROUTER_MANDATORY`` + ``SNDTIMEO``); ``None`` drops silently.
        on_reject: called with the peer's routing id (``b""`` on a DEALER) and the
            :class:`~dpool.errors.ProtocolError` of every frame that failed a check.
    """

    def __init__(self, ctx: zmq.Context, router: bool, key: bytes, max_bytes: int, ident: bytes | None = None,
                 send_timeout_ms: int | None = None,
                 on_reject: Callable[[bytes, ProtocolError], None] | None = None) -> None:
        self.codec = P.Codec(key, max_bytes)
        self.router = router
        self.sock = ctx.socket(zmq.ROUTER if router else zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + _FRAME_SLACK)
        if ident is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, ident)
        if router and send_timeout_ms is not None:
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
        self._seq_out = 0
        self._open = False  # a ROUTER send is under way (or was cut short) between its two frames
        self._seen: dict[bytes, int] = {}  # peer → highest sequence number accepted from it
        self.last_seq = 0  # of the message recv() and recv_nowait() returned last
        self.last_re = 0  # the request that message answers (0: not a reply)
        self.rejected = 0
        self.key_rejected = False  # a DEALER's peer answered KEY_REJECTED
        self._on_reject = on_reject

    # ------------------------------------------------------------------ set-up
    def rekey(self, key: bytes) -> None:
        """Authenticate with ``key`` from now on (a daemon session's derived key)."""
        self.codec = P.Codec(key, self.codec.max_bytes)

    def bind(self, endpoint: str) -> str:
        """Bind to ``endpoint``; an ``ipc://`` socket file is made private (0600). Returns the bound endpoint."""
        self.sock.bind(endpoint)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], 0o600)
        return self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def connect(self, endpoint: str) -> None:
        self.sock.connect(endpoint)

    def forget(self, peer: bytes) -> None:
        """Drop a peer's sequence record (a peer that will not talk again)."""
        self._seen.pop(peer, None)

    # ------------------------------------------------------------------ sending
    def next_seq(self) -> int:
        """A sequence number no other message of this channel gets, for :meth:`send`'s ``seq``."""
        self._seq_out += 1
        return self._seq_out

    def send(self, msg: P.Message, peer: bytes | None = None, flags: int = 0, seq: int = 0, re: int = 0) -> None:
        """Send ``msg`` (to ``peer`` on a ROUTER), numbered ``seq`` (0: the next number), answering the
        request numbered ``re``. Raises :class:`zmq.ZMQError` when it cannot be sent."""
        frame = self.codec.encode(msg, seq or self.next_seq(), re)
        flags = int(flags)
        if peer is None:
            _send(self.sock, frame, flags)
            return
        sock = self.sock
        if self._open:  # an earlier send was cut between its frames: end that message (its peer drops it)
            _end_cut_message(sock)
        self._open = True
        _send(sock, peer, _SNDMORE | flags)
        _send(sock, frame, flags)
        self._open = False

    def try_send(self, msg: P.Message, peer: bytes | None = None, re: int = 0) -> bool:
        """Send without blocking; ``False`` when the peer is gone or its queue is full."""
        try:
            self.send(msg, peer, _NOBLOCK, re=re)
            return True
        except zmq.ZMQError:
            return False

    # ------------------------------------------------------------------ receiving
    def poll(self, timeout_ms: int | None = None) -> bool:
        """Whether a frame arrived within ``timeout_ms`` (``None``: wait for one)."""
        return bool(self.sock.poll(timeout_ms))

    def _frames(self, flags: int) -> list[bytes]:
        """One whole message's frames (``recv_multipart`` without its per-call enum arithmetic)."""
        sock = self.sock
        frames = [_recv(sock, flags)]
        if self.router:  # a ROUTER's first frame is the peer's id, always followed by the peer's own frames
            frames.append(_recv(sock, flags))  # (a message arrives whole, so this never waits)
        while sock.get(_RCVMORE):
            frames.append(_recv(sock, flags))
        return frames

    def recv(self) -> tuple[bytes, P.Message]:
        """Block until an authenticated message arrives; returns ``(peer, message)``."""
        while True:
            got = self._accept(self._frames(0))
            if got is not None:
                return got

    def recv_nowait(self) -> tuple[bytes, P.Message] | None:
        """The next authenticated message if one is queued, else ``None`` (rejected frames are skipped)."""
        while True:
            try:  # one failed receive per drain costs less than an EVENTS query per message
                frames = self._frames(_NOBLOCK)
            except zmq.Again:
                return None
            got = self._accept(frames)
            if got is not None:
                return got

    def drain(self) -> list[tuple[bytes, P.Message]]:
        """Every authenticated message queued now, in arrival order."""
        out: list[tuple[bytes, P.Message]] = []
        while True:
            got = self.recv_nowait()
            if got is None:
                return out
            out.append(got)

    def _accept(self, frames: list[bytes]) -> tuple[bytes, P.Message] | None:
        peer = frames[0] if self.router else b""
        body = frames[1:] if self.router else frames
        if body == _CUT:  # the end of a message whose send was cut short (see send): nothing in it
            return None
        if not self.router and body == [KEY_REJECTED]:
            self.key_rejected = True
            return None
        try:
            seq, re, msg = self.codec.decode(body)
            if seq <= self._seen.get(peer, -1):
                raise ProtocolError(f"replayed or reordered message (seq {seq} ≤ {self._seen[peer]})")
        except ProtocolError as exc:
            self.rejected += 1
            if self._on_reject is not None:
                self._on_reject(peer, exc)
            return None
        self._seen[peer] = seq
        self.last_seq, self.last_re = seq, re
        return peer, msg

    # ------------------------------------------------------------------ end
    @property
    def closed(self) -> bool:
        return bool(self.sock.closed)

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket; ``linger_ms``: how long the context's ``term()`` may then spend delivering
        messages still queued (0: dropped)."""
        if not self.sock.closed:
            self.sock.close(linger=linger_ms)
