#!/bin/bash
cat > /app/report.py <<'PY'
import csv
import json
import sys
from decimal import Decimal

totals = {}
with open(sys.argv[1], newline="") as f:
    for row in csv.DictReader(f):
        amount = (row["amount"] or "").strip()
        if amount:
            totals[row["category"]] = totals.get(row["category"], Decimal(0)) + Decimal(amount)
print(json.dumps({k: float(round(v, 2)) for k, v in sorted(totals.items())}))
PY
