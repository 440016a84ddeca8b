"""A training run: the driver (the algorithm, over roles furlong.build makes) and its phases."""
