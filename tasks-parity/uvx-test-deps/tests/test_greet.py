import sys

import six  # fetched by uvx at test time, as Terminal-Bench 2's tests fetch theirs

sys.path.insert(0, "/app")
from greet import greet  # noqa: E402


def test_greet():
    assert greet("Ada") == "Hello, Ada!"
    assert isinstance(greet(six.text_type("x")), six.string_types)
