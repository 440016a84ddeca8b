"""A tiny bank-account model."""


class InsufficientFunds(Exception):
    pass


class Account:
    def __init__(self, owner, balance=0, history=[]):
        self.owner = owner
        self.balance = balance
        self.history = history

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))

    def withdraw(self, amount):
        if amount <= 0:
            raise ValueError("withdrawal must be positive")
        if amount >= self.balance:
            raise InsufficientFunds(f"{self.owner} has only {self.balance}")
        self.balance -= amount
        self.history.append(("withdraw", amount))


def transfer(src, dst, amount):
    """Moves amount from src to dst; on failure neither account changes."""
    dst.deposit(amount)
    src.withdraw(amount)
