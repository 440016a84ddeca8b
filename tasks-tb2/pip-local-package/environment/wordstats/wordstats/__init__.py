"""A tiny local package: installed with pip in the image, from its source, without network."""

from collections import Counter


def most_common(text: str) -> str:
    return Counter(text.lower().split()).most_common(1)[0][0]
