#!/bin/bash
cd /app
python3 - <<'PY'
p = "bank.py"
s = open(p).read()
s = s.replace("balance=0, history=[]):", "balance=0, history=None):")
s = s.replace("self.history = history\n", "self.history = [] if history is None else history\n")
s = s.replace("if amount >= self.balance:", "if amount > self.balance:")
s = s.replace("    dst.deposit(amount)\n    src.withdraw(amount)\n", "    src.withdraw(amount)\n    dst.deposit(amount)\n")
open(p, "w").write(s)
PY
