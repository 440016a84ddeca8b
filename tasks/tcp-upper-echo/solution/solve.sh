#!/bin/bash
cat > /app/upper_server.py <<'PY'
import socketserver


class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(line.rstrip(b"\n").upper() + b"\n")


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


Server(("127.0.0.1", 9009), Handler).serve_forever()
PY
setsid nohup python3 /app/upper_server.py > /tmp/upper_server.log 2>&1 < /dev/null &
for i in $(seq 50); do python3 -c "import socket; socket.create_connection(('127.0.0.1', 9009), 1)" 2>/dev/null && break; sleep 0.2; done
