#!/bin/bash
echo 0 > /logs/verifier/reward.txt
python3 /tests/kvserver.py /srv/kv 7071 2>/logs/verifier/server.log &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 50); do
  got=$(curl -s http://127.0.0.1:7071/greeting) && break
  kill -0 $server 2>/dev/null || { cat /logs/verifier/server.log; exit 0; }
  sleep 0.1
done
[ "$got" = hello ] && [ "$(curl -s http://127.0.0.1:7071/answer)" = 42 ] || { echo "got: $got"; exit 0; }
echo 1 > /logs/verifier/reward.txt
