import unittest

from roman import from_roman, to_roman

SYMBOLS = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
           (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def reference(n):
    out = ""
    for value, sym in SYMBOLS:
        while n >= value:
            out, n = out + sym, n - value
    return out


class FullRomanTest(unittest.TestCase):
    def test_all_numbers_both_ways(self):
        for n in range(1, 4000):
            self.assertEqual(to_roman(n), reference(n), n)
            self.assertEqual(from_roman(reference(n)), n, reference(n))

    def test_out_of_range(self):
        for n in (0, -1, -3999, 4000, 10000):
            with self.assertRaises(ValueError):
                to_roman(n)

    def test_invalid_numerals(self):
        for s in ("", "IIII", "IC", "ABC", "VV", "XXXX", "IL", "MMMM", "VX", "IIV", "CMC", "MCMC", "iv", "X I"):
            with self.assertRaises(ValueError, msg=s):
                from_roman(s)


if __name__ == "__main__":
    unittest.main()
