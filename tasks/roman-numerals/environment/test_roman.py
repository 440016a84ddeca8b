import unittest

from roman import from_roman, to_roman


class RomanTest(unittest.TestCase):
    def test_examples(self):
        for n, s in [(1, "I"), (4, "IV"), (9, "IX"), (14, "XIV"), (40, "XL"), (90, "XC"),
                     (400, "CD"), (1994, "MCMXCIV"), (2024, "MMXXIV"), (3999, "MMMCMXCIX")]:
            self.assertEqual(to_roman(n), s)
            self.assertEqual(from_roman(s), n)

    def test_out_of_range(self):
        for n in (0, -1, 4000):
            with self.assertRaises(ValueError):
                to_roman(n)

    def test_invalid_numerals(self):
        for s in ("", "IIII", "IC", "ABC"):
            with self.assertRaises(ValueError):
                from_roman(s)


if __name__ == "__main__":
    unittest.main()
