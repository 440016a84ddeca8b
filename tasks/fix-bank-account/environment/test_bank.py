import unittest

from bank import Account, InsufficientFunds, transfer


class AccountTest(unittest.TestCase):
    def test_deposit_and_withdraw(self):
        a = Account("ana", 100)
        a.deposit(50)
        a.withdraw(30)
        self.assertEqual(a.balance, 120)
        self.assertEqual(a.history, [("deposit", 50), ("withdraw", 30)])

    def test_histories_are_independent(self):
        a, b = Account("ana"), Account("bram")
        a.deposit(10)
        self.assertEqual(b.history, [])

    def test_withdraw_entire_balance(self):
        a = Account("ana", 40)
        a.withdraw(40)
        self.assertEqual(a.balance, 0)

    def test_overdraw_refused(self):
        a = Account("ana", 40)
        with self.assertRaises(InsufficientFunds):
            a.withdraw(41)
        self.assertEqual(a.balance, 40)

    def test_invalid_amounts(self):
        a = Account("ana", 40)
        for bad in (0, -5):
            with self.assertRaises(ValueError):
                a.deposit(bad)
            with self.assertRaises(ValueError):
                a.withdraw(bad)

    def test_transfer(self):
        a, b = Account("ana", 100), Account("bram", 5)
        transfer(a, b, 60)
        self.assertEqual((a.balance, b.balance), (40, 65))

    def test_failed_transfer_changes_nothing(self):
        a, b = Account("ana", 10), Account("bram", 5)
        with self.assertRaises(InsufficientFunds):
            transfer(a, b, 60)
        self.assertEqual((a.balance, b.balance), (10, 5))
        self.assertEqual((a.history, b.history), ([], []))


if __name__ == "__main__":
    unittest.main()
