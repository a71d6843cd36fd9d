"""Answering a failing rank: every rank of a job listens for a request for its last calls (a
TCP socket, and a thread asleep in accept: nothing per call), so that a rank whose call
failed can show where every rank it reaches is, on its host and on others, those outside
any call included.

A request is the job's token (drawn by rank 0: only the job's own ranks are answered); the
answer is the rank's trace content (commlib/tracer.py) and its clock, from which the asker
puts the answer on its own clock (off by at most half the round trip).
"""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ASK_SECONDS = 2.0  # how long a failing rank waits for the others' answers, at most
_MOST_BYTES = 1 << 28  # an answer larger than this is not a rank's last calls


class Responder:
    """This rank's listener: answers the job's ``token`` with ``content()`` (a dict)."""

    def __init__(self, token: str, content, loopback: bool):
        self.token, self.content = token.encode(), content
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1" if loopback else "", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, name="commlib-responder", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(ASK_SECONDS)
                    if _read(conn, len(self.token) + 1) != self.token + b"\n":
                        continue
                    answer = {"now": time.monotonic(), "content": self.content()}
                    conn.sendall(json.dumps(answer).encode())
                except Exception:  # noqa: BLE001 - whatever one request meets, serve the next
                    continue  # (the asker gave up, say, or the content changed while read)

    def close(self) -> None:
        # shutting down wakes the thread in accept(); on Linux closing alone does not
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()


def ask(peers: dict, token: str, seconds: float = ASK_SECONDS) -> dict:
    """{rank: (its content, its clock minus this one's)} for the ``peers`` ({rank: (host,
    port)}) that answer within ``seconds``, asked all at once."""
    if not peers:
        return {}
    deadline = time.monotonic() + seconds

    def one(address):
        sent = time.monotonic()
        with socket.create_connection(address, timeout=max(0.01, deadline - sent)) as s:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            s.sendall(token.encode() + b"\n")
            answer = json.loads(_read(s, _MOST_BYTES))
        back = time.monotonic()
        return answer["content"], answer["now"] - (sent + back) / 2

    answers = {}
    with ThreadPoolExecutor(min(16, len(peers))) as pool:
        asked = {rank: pool.submit(one, address) for rank, address in peers.items()}
        for rank, future in asked.items():
            try:
                answers[rank] = future.result()
            except (OSError, ValueError, KeyError):
                pass  # unreachable: dead, or stuck holding the interpreter
    return answers


def _read(conn: socket.socket, most: int) -> bytes:
    """What ``conn`` sends until it closes, or ``most`` bytes."""
    chunks, size = [], 0
    while size < most:
        chunk = conn.recv(min(1 << 20, most - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
