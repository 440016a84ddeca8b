from furlong.sandbox.runtime.native import build_all

build_all()
