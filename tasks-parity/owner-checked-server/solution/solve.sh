#!/bin/bash
set -e
mkdir -p /srv/kv
chmod 700 /srv/kv
printf '{"greeting": "hello", "answer": "42"}\n' > /srv/kv/kv.json
