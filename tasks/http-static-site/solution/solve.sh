#!/bin/bash
cd /app/site
setsid nohup python3 -m http.server 8123 --bind 127.0.0.1 > /tmp/http.log 2>&1 < /dev/null &
for i in $(seq 50); do python3 -c "import socket; socket.create_connection(('127.0.0.1', 8123), 1)" 2>/dev/null && break; sleep 0.2; done
