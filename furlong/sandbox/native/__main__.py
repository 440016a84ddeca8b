from furlong.sandbox.native import build_all

build_all()
