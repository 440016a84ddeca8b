#!/bin/bash
mkdir -p /logs/verifier
# only the copied files reach the final image, not the builder's tree
[ ! -e /build ] && [ "$(countlines /app/squares.txt)" = 20 ] \
  && [ "$(cat /app/big.txt 2>/dev/null)" = "$(printf 'item-%s\n' $(seq 15 20))" ]
rc=$?
if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
