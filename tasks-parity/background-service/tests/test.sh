#!/bin/bash
# A service the agent left running, under the agent's own uid: the tests reach it, and see its process as
# root's, as under Docker.
echo 0 > /logs/verifier/reward.txt
[ "$(curl -s http://127.0.0.1:8765/index.html)" = "parity ok" ] || exit 0
pid=$(pgrep -f 'http.server 8765' | head -n1)
[ -n "$pid" ] || { echo "no server process"; exit 0; }
[ "$(stat -c %U /proc/$pid)" = root ] || { echo "server runs as $(stat -c %U /proc/$pid)"; exit 0; }
echo 1 > /logs/verifier/reward.txt
