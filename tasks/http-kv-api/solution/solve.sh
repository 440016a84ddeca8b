#!/bin/bash
cat > /app/kv_server.py <<'PY'
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STORE = {}


class Handler(BaseHTTPRequestHandler):
    def _key(self):
        return self.path[len("/kv/"):] if self.path.startswith("/kv/") else None

    def _reply(self, status, body=b""):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self):
        length = int(self.headers.get("Content-Length") or 0)
        STORE[self._key()] = self.rfile.read(length)
        self._reply(200)

    def do_GET(self):
        key = self._key()
        self._reply(200, STORE[key]) if key in STORE else self._reply(404)

    def do_DELETE(self):
        key = self._key()
        if key in STORE:
            del STORE[key]
            self._reply(200)
        else:
            self._reply(404)

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", 8088), Handler).serve_forever()
PY
setsid nohup python3 /app/kv_server.py > /tmp/kv_server.log 2>&1 < /dev/null &
for i in $(seq 50); do python3 -c "import socket; socket.create_connection(('127.0.0.1', 8088), 1)" 2>/dev/null && break; sleep 0.2; done
