import sys
from collections import Counter


def count_words(text):
    counts = Counter()
    for word in text.split(" "):
        counts[word.lower()] += 1
    return counts


def top_words(counts, n):
    return sorted(counts.items(), key=lambda kv: kv[1], reverse=True)[:n]


def main():
    path, n = sys.argv[1], int(sys.argv[2])
    with open(path) as f:
        counts = count_words(f.read())
    for word, count in top_words(counts, n):
        print(f"{word} {count}")


if __name__ == "__main__":
    main()
