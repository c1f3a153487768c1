"""A stand-in OpenAI-compatible server for the serving tests that are about
processes, not models: `/health` and `/v1/models` only. Started as a real process
through a command template (`python health_server.py --port P --name N`);
`--never-healthy` answers 503 forever, `--ignore-sigterm` makes SIGKILL necessary."""

import argparse
import http.server
import json
import signal

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--name", required=True)
parser.add_argument("--never-healthy", action="store_true")
parser.add_argument("--ignore-sigterm", action="store_true")
args = parser.parse_args()
if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            status, body = (503, b"starting") if args.never_healthy else (200, b"ok")
        elif self.path == "/v1/models":
            status = 200
            body = json.dumps({"object": "list", "data": [{"id": args.name}]}).encode()
        else:
            status, body = 404, b"not found"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
