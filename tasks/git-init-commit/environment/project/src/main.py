from util import double

print(double(21))
