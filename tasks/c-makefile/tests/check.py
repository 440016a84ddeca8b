import glob
import os
import subprocess

EXPECTED = "sum 4.0 2.0\ndot -5.0\nlen 5.0\n"


def make(*args):
    r = subprocess.run(["make", *args], cwd="/app", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"make {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"


assert os.path.isfile("/app/Makefile"), "no /app/Makefile"
assert subprocess.run(["/app/vecdemo"], capture_output=True, text=True, timeout=10).stdout == EXPECTED, "vecdemo not built"
make("clean")
assert not os.path.exists("/app/vecdemo"), "make clean left vecdemo"
assert glob.glob("/app/src/*.o") == [], "make clean left object files"
make()
assert sorted(glob.glob("/app/src/*.o")) == ["/app/src/main.o", "/app/src/vec.o"], glob.glob("/app/src/*.o")
out = subprocess.run(["/app/vecdemo"], capture_output=True, text=True, timeout=10, check=True).stdout
assert out == EXPECTED, out
make("clean")
assert not os.path.exists("/app/vecdemo") and glob.glob("/app/src/*.o") == []
print("ok")
