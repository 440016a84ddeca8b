import sys

sys.path.insert(0, "/app")

from slug import slugify  # noqa: E402


def test_example():
    assert slugify("  Hello, World!  ") == "hello-world"


def test_runs_collapse():
    assert slugify("a__b  c--d") == "a-b-c-d"


def test_digits_kept():
    assert slugify("Release 2.0") == "release-2-0"
