#!/bin/bash
set -e
mkdir -p /app/www
echo 'parity ok' > /app/www/index.html
setsid nohup python3 -m http.server 8765 --bind 127.0.0.1 --directory /app/www >/dev/null 2>&1 < /dev/null &
for _ in $(seq 50); do curl -sf http://127.0.0.1:8765/index.html >/dev/null && exit 0; sleep 0.1; done
exit 1
