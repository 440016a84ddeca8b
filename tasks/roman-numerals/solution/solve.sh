#!/bin/bash
cat > /app/roman.py <<'PY'
SYMBOLS = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
           (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def to_roman(n):
    if not isinstance(n, int) or not 1 <= n <= 3999:
        raise ValueError(f"out of range: {n!r}")
    out = []
    for value, sym in SYMBOLS:
        while n >= value:
            out.append(sym)
            n -= value
    return "".join(out)


_TABLE = {to_roman(n): n for n in range(1, 4000)}


def from_roman(s):
    try:
        return _TABLE[s]
    except (KeyError, TypeError):
        raise ValueError(f"not a Roman numeral: {s!r}") from None
PY
