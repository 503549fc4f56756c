"""The benches' S3 bucket on loopback: moto's S3 backend served by uvicorn, not by moto's own server.

It stands in for a remote bucket, so its own cost on this machine is noise in what a bench
measures. moto's server (werkzeug's development server) spent, a request, what uvicorn does not
(a 1.8 MB checkpoint PUT and a small PUT, its CPU at idle here): a thread started for each
connection, the HTTP chunked body decoded in Python, and a search through every moto service
for the one a request is for. Same backend, same wire protocol: ~8.0 -> 7.5 ms of server CPU for
the large PUT, 1.5-1.8 -> 0.8-1.0 ms for the small one; over a pair of bench/checkpoint.py, 0.9
-> 0.7 CPU-seconds. The rest of the large PUT is moto's own work on the bytes (the MD5 for its
ETag, the aws-chunked decoding).

uvicorn ships with Ray Serve. Its WSGI layer hands the application the whole body at once but
does not say where the body ends when the client sent it chunked (the AWS SDK's aws-chunked
uploads): without ``wsgi.input_terminated`` werkzeug would read such a body as empty and the
object would be stored with no bytes (tests/unit/test_bench_parts.py reads one back).

    python bench/s3_server.py PORT
"""

from __future__ import annotations

import sys


def s3_app():
    """moto's S3 backend as a WSGI application that reads a chunked body to its end."""
    from moto.server import create_backend_app

    s3 = create_backend_app("s3")

    def app(environ, start_response):
        environ["wsgi.input_terminated"] = True  # uvicorn's WSGI layer passes the whole body, chunked or not
        return s3(environ, start_response)

    return app


def main() -> None:
    import uvicorn

    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        raise SystemExit(__doc__)
    uvicorn.run(s3_app(), host="127.0.0.1", port=int(sys.argv[1]), interface="wsgi", http="httptools",
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
