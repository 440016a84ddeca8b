#!/bin/bash
# Builds /app/data deterministically: mkfile PATH SIZE writes SIZE bytes.
set -e
mkfile() { mkdir -p "$(dirname "$1")"; head -c "$2" /dev/zero | tr '\0' 'x' > "$1"; }
cd /app/data
mkfile services/api/today.log 4096
mkfile services/api/yesterday.log 1024
mkfile services/api/notes.txt 9000
mkfile services/web/access.log 1025
mkfile services/web/error.log 12
mkfile services/web/Old.log 70000
mkfile archive/2023/jan.log 2048
mkfile archive/2023/feb.log 100
mkfile archive/2023/mar.log.gz 5000
mkfile archive/Zeta.log 3000
mkfile archive/readme.md 2000
mkfile tmp/debug.LOG 8000
mkfile tmp/run.log.bak 8000
mkfile "tmp/space name.log" 1500
mkfile top.log 1100
mkfile empty.log 0
mkdir -p folder.log/inner
mkfile folder.log/inner/data.bin 5000
