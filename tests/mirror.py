"""A dataset mirror on 127.0.0.1 for ``sven data fetch`` tests: no test reaches the internet.

``serve(root)`` serves a folder over HTTP from a thread of this process, plus one broken
route: ``/truncated/F`` announces F's length and sends half of it, then closes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Mirror(SimpleHTTPRequestHandler):
    root: Path
    hits: list[str]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, directory=str(self.root), **kwargs)

    def do_GET(self) -> None:
        self.hits.append(self.path)
        if self.path.startswith("/truncated/"):
            body = (self.root / self.path.removeprefix("/truncated/")).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        super().do_GET()

    def log_message(self, *args) -> None:  # quiet
        pass


@contextmanager
def serve(root: Path) -> Iterator[tuple[str, list[str]]]:
    """Serves ``root`` on 127.0.0.1; yields the base URL and the list of requested paths."""
    hits: list[str] = []
    handler = type("Handler", (_Mirror,), {"root": root, "hits": hits})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
