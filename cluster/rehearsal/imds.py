"""A fake EC2 instance metadata service (IMDSv2): the only fake in the spot tests and the rehearsal.

It answers as AWS documents: a session token by PUT, documents only with that token, 404
where there is no notice. In tests it runs on 127.0.0.1 in-process; in the rehearsal it runs
inside a worker's network namespace at the real address, 169.254.169.254:80, so
`etrain spot-watch` polls its default endpoint unchanged, and a notice is served once the
file named by ``--notice-file`` exists (the rehearsal writes it to interrupt that node).

    python -m cluster.rehearsal.imds --host 169.254.169.254 --port 80 --notice-file PATH
"""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
TOKEN = "tok-123"


class FakeIMDS:
    """IMDSv2 on ``host:port`` (port 0: any free one); ``documents`` maps paths to bodies."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, notice_file: Path | None = None):
        self.documents: dict[str, str] = {}
        self.token_requests = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_PUT(self):
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    fake.token_requests += 1
                    self._send(200, TOKEN)
                else:
                    self._send(400, "")

            def do_GET(self):
                if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
                    return self._send(401, "")
                body = fake.documents.get(self.path)
                if body is None and self.path == INSTANCE_ACTION and notice_file is not None and notice_file.exists():
                    body = notice_file.read_text()
                self._send(200, body) if body is not None else self._send(404, "")

            def _send(self, code, body):
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="169.254.169.254")
    parser.add_argument("--port", type=int, default=80)
    parser.add_argument("--notice-file", type=Path, required=True,
                        help="serve this file's JSON as spot/instance-action once it exists")
    args = parser.parse_args(argv)
    imds = FakeIMDS(args.host, args.port, args.notice_file)
    imds.thread.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
