#!/bin/bash
cd /app/data && find . -type f -name '*.log' -size +1024c | sed 's|^\./||' | LC_ALL=C sort > /app/big_logs.txt
