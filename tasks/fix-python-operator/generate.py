"""Task family fix-python-operator: Fix a one-character bug in a named function of a generated Python module.

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, python_test, write_task


# Each template: (names, source with {name}, (correct text, buggy text), spec, argument generator).
# The buggy text replaces the correct one exactly once; generate() checks that the bug changes results.
TEMPLATES = [
    (["add_tax", "with_tax", "gross_price"],
     "def {name}(price, rate):\n    return price + price * rate\n",
     ("price + price", "price - price"),
     "return `price` plus `price * rate`",
     lambda r: (r.randint(1, 500), r.choice([0.1, 0.2, 0.25, 0.5]))),
    (["count_above", "num_greater", "count_over"],
     "def {name}(xs, limit):\n    return sum(1 for x in xs if x > limit)\n",
     ("x > limit", "x < limit"),
     "return how many items of the list `xs` are strictly greater than `limit`",
     lambda r: ([r.randint(0, 20) for _ in range(r.randint(3, 9))], r.randint(5, 15))),
    (["is_even", "even", "is_multiple_of_two"],
     "def {name}(n):\n    return n % 2 == 0\n",
     ("== 0", "== 1"),
     "return `True` if the integer `n` is even and `False` otherwise",
     lambda r: (r.randint(-50, 50),)),
    (["average", "mean_value", "avg"],
     "def {name}(xs):\n    return sum(xs) / len(xs)\n",
     ("sum(xs) / len", "sum(xs) * len"),
     "return the arithmetic mean of the non-empty list `xs`",
     lambda r: ([r.randint(1, 40) for _ in range(r.randint(2, 6))],)),
    (["last_items", "tail", "take_last"],
     "def {name}(xs, n):\n    return xs[-n:]\n",
     ("xs[-n:]", "xs[n:]"),
     "return the last `n` items of the list `xs` (1 <= n <= len(xs))",
     lambda r: (lambda xs: (xs, r.randint(1, len(xs) // 2)))([r.randint(0, 9) for _ in range(r.randint(5, 9))])),
    (["larger", "max_of_two", "bigger"],
     "def {name}(a, b):\n    return a if a > b else b\n",
     ("a > b", "a < b"),
     "return the larger of the two numbers `a` and `b`",
     lambda r: (r.randint(-99, 99), r.randint(-99, 99))),
    (["factorial", "fact", "product_up_to"],
     "def {name}(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
     ("n + 1", "n - 1"),
     "return `n!`, the product `1 * 2 * ... * n` (with `0! = 1`)",
     lambda r: (r.randint(3, 12),)),
    (["count_vowels", "vowel_count", "num_vowels"],
     'def {name}(text):\n    return sum(1 for c in text.lower() if c in "aeiou")\n',
     ('"aeiou"', '"aeio"'),
     "return how many characters of `text` are vowels (`a e i o u`, either case)",
     lambda r: ("".join(r.choice("aeiouUbcdrstxyz ") for _ in range(r.randint(8, 20))) + "u",)),
    (["square", "squared", "sq"],
     "def {name}(x):\n    return x * x\n",
     ("x * x", "x + x"),
     "return `x` multiplied by itself",
     lambda r: (r.randint(3, 99),)),
    (["clamp", "limit_to", "bound"],
     "def {name}(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n",
     ("if x < lo", "if x > lo"),
     "return `x` limited to the range from `lo` to `hi` (`lo` if `x < lo`, `hi` if `x > hi`, else `x`)",
     lambda r: (r.randint(-20, 40), 0, 20)),
]


def _call(source: str, name: str, args: tuple):
    namespace: dict = {}
    exec(source, namespace)
    return namespace[name](*args)


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    chosen = rng.sample(range(len(TEMPLATES)), 3)
    buggy_idx = chosen[0]
    rng.shuffle(chosen)
    module = f"{rng.choice(['utils', 'helpers', 'mathlib', 'tools', 'calc', 'funcs'])}_{rng.choice(WORDS)}"
    funcs, good_parts, bad_parts = [], [], []
    for i in chosen:
        names, src, (right, wrong), spec, gen_args = TEMPLATES[i]
        name = rng.choice(names)
        good = src.format(name=name)
        bad = good.replace(right, wrong, 1) if i == buggy_idx else good
        good_parts.append(good)
        bad_parts.append(bad)
        cases = [gen_args(rng) for _ in range(12)]
        funcs.append((name, good, bad, cases))
        if i == buggy_idx:
            target, target_spec = name, spec
    good_src, bad_src = "\n\n".join(good_parts), "\n\n".join(bad_parts)
    expected = []
    for name, good, bad, cases in funcs:
        for args in cases:
            expected.append((name, list(args), _call(good, name, args)))
    assert any(_call(bad_src, n, tuple(a)) != want for n, a, want in expected if n == target), "the bug must show"
    check = (
        "import importlib.util\n\n"
        f"spec = importlib.util.spec_from_file_location('m', '/app/{module}.py')\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "CASES = [  # (function, arguments, expected result)\n"
        + "".join(f"    {case!r},\n" for case in expected)
        + "]\n"
        "for name, args, want in CASES:\n"
        "    got = getattr(m, name)(*args)\n"
        "    ok = abs(got - want) < 1e-9 if isinstance(want, float) else got == want\n"
        "    assert ok, f'{name}{tuple(args)} = {got!r}, want {want!r}'\n"
        "print('ok')\n"
    )
    write_task(
        out,
        instruction=(f"The function `{target}` in `/app/{module}.py` should {target_spec}, but a one-character bug "
                     "makes it return wrong results. Fix the bug; do not change the other functions."),
        category="python-bugfix", difficulty="medium", tags=["python", "debugging"],
        env_files={f"{module}.py": bad_src},
        test_files={"check.py": check},
        test_sh=python_test(f"Calls every function in /app/{module}.py on fixed inputs and compares with the correct results."),
        solve_sh=f"cat > /app/{module}.py <<'PY'\n{good_src}PY",
        agent_timeout=180.0,
    )
