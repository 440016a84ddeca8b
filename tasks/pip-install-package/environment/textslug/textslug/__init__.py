"""URL slugs: lower-case words of letters and digits joined by '-'."""

import re
import sys

__version__ = "1.2.0"


def slugify(text: str, sep: str = "-") -> str:
    return sep.join(re.findall(r"[a-z0-9]+", text.lower()))


def main() -> None:
    print(slugify(" ".join(sys.argv[1:])))
