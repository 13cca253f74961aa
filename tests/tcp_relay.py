"""A TCP relay for tests that need to see or cut a connection between two real processes: it forwards both
ways, counts the bytes from the server side, and past `hold_after` bytes stops reading the server's side (TCP
holds the server back: its sends block once the small receive buffer and its own send buffer are full) until
`resume()`, after which it reads and drops what comes, so it sees the server go away. When the server's side
ends, the client's is closed, as a dead server's connection would be. Used to kill a peer mid-stream at a known point (the client has received
some of a stream and not the rest)."""
from __future__ import annotations

import socket
import threading


class TcpRelay:
    def __init__(self, target: tuple[str, int], hold_after: int | None = None) -> None:
        self.target = target
        self.hold_after = hold_after  # bytes from the server passed on before holding the rest back
        self.from_server = 0  # bytes read from the server
        self.passed = 0  # of those, passed on to the client
        self.server_closed = threading.Event()  # the server's side ended (EOF or reset)
        self.holding = threading.Event()  # hold_after bytes passed: the server's side is not read
        self._resume = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._guard = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="tcp-relay").start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.socket()
            server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # before connecting: a small window
            server.connect(self.target)
            with self._guard:
                self._socks += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if from_server:
                    with self._guard:
                        self.from_server += len(data)
                        room = len(data) if self.hold_after is None else max(0, self.hold_after - self.passed)
                        data = data[:room]
                        self.passed += len(data)
                    if self.hold_after is not None and self.passed >= self.hold_after and not self._resume.is_set():
                        if data:
                            dst.sendall(data)
                        self.holding.set()
                        self._resume.wait()
                        continue
                if data:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            if from_server:
                self.server_closed.set()
                for s in (dst, src):  # the client sees the connection go, as it would with no relay
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def resume(self) -> None:
        """Reads the server's side again (dropping what comes) to see it end."""
        self._resume.set()

    def cut(self) -> None:
        """Closes every connection (both sides) and stops listening."""
        self._resume.set()
        with self._guard:
            socks, self._socks = self._socks, []
        for s in [self._listener, *socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
