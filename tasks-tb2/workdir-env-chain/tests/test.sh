#!/bin/bash
# The tests run in the image's WORKDIR with its ENV (PATH included), as in Harbor.
mkdir -p /logs/verifier
[ "$PWD" = /srv/app/data ] && [ "$APP_HOME" = /srv/app ] && [ "$(command -v appinfo)" = /srv/app/bin/appinfo ] \
  && [ "$(cat /srv/app/report.txt 2>/dev/null)" = "$(printf 'mode=release build home=/srv/app\nseed-42')" ]
rc=$?
if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
