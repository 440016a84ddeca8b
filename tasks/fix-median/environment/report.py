import sys

from stats import mean, median, variance


def main(path):
    xs = [float(line) for line in open(path) if line.strip()]
    print(f"count    {len(xs)}")
    print(f"mean     {mean(xs):.3f}")
    print(f"median   {median(xs):.3f}")
    print(f"variance {variance(xs):.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
