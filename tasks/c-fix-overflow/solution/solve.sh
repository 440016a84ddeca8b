#!/bin/bash
cd /app
sed -i -e 's/int total = 0;/long long total = 0;/' -e 's/i < n; i++/i <= n; i++/' \
       -e 's/total += i \* i;/total += (long long)i * i;/' -e 's/printf("%d\\n", total);/printf("%lld\\n", total);/' sumsq.c
gcc -O2 -Wall -o /app/sumsq sumsq.c
