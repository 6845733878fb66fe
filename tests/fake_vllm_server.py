"""A stand-in for vLLM's OpenAI API server, for tests of what quantgate does when a server dies:
`python tests/fake_vllm_server.py PORT MODE [HOST]` (HOST 127.0.0.1 by default; an IPv6 address binds
IPv6). It answers GET /health and the first POST
/v1/completions (quantgate's smoke request) as vLLM does. Every later request logs, as vLLM's
engine does when one step outlasts its RPC timeout, the error line ENGINE_ERROR; then, with MODE
"hang", leaves the request unanswered until the test kills the process, and with MODE "exit" the
process exits with code 1. Its stdout is the server log. Like vLLM, it leaves a socket in
VLLM_RPC_BASE_PATH."""

import json
import os
import signal
import socket
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

ENGINE_ERROR = "TimeoutError: RPC call to execute_model timed out."
# the line as vLLM 0.x prints it: a process prefix, a level, a timestamp and the source
LOGGED = f"(EngineCore_DP0 pid={os.getpid()}) ERROR 12-04 10:00:00 [core.py:842] {ENGINE_ERROR}"


class Handler(BaseHTTPRequestHandler):
    answered = 0

    def log_message(self, *args):  # the log holds only what the test reads
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if Handler.answered == 0:
            Handler.answered += 1
            body = json.dumps({"choices": [{"text": "Hi", "index": 0}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            print("INFO ready: answered the first request", flush=True)
            return
        print(LOGGED, flush=True)
        if sys.argv[2] == "exit":
            os._exit(1)
        while True:  # hang, as an engine that no longer steps
            signal.pause()


if __name__ == "__main__":
    # vLLM's engine binds its ZMQ IPC sockets in VLLM_RPC_BASE_PATH and leaves them there
    if base := os.environ.get("VLLM_RPC_BASE_PATH"):
        ipc = socket.socket(socket.AF_UNIX)
        ipc.bind(os.path.join(base, f"fake-{os.getpid()}"))
    # an error line from before it was ready, as vLLM CPU logs one at each start: never a death's reason
    print("WARNING 12-04 09:59:00 [importing.py:44] ModuleNotFoundError: No module named 'triton'", flush=True)
    host = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
    server = type("Server", (HTTPServer,), {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
    server((host, int(sys.argv[1])), Handler).serve_forever()
