import socket
import time

ADDR = ("127.0.0.1", 9009)


def connect():
    for attempt in range(20):  # the server may still be starting
        try:
            s = socket.create_connection(ADDR, timeout=5)
            return s, s.makefile("rb")
        except OSError:
            time.sleep(0.5)
    raise AssertionError("nothing listens on 127.0.0.1:9009")


def ask(conn, line):
    sock, reader = conn
    sock.sendall(line.encode() + b"\n")
    return reader.readline().decode()


a = connect()
b = connect()  # two clients open at the same time
assert ask(a, "hello, World 42") == "HELLO, WORLD 42\n"
assert ask(b, "second client") == "SECOND CLIENT\n"
assert ask(a, "still here?") == "STILL HERE?\n"
assert ask(b, "") == "\n"
for conn in (a, b):
    conn[0].close()
c = connect()  # a new client after the others left
for word in ["alpha", "mixed CaSe", "tabs\tand  spaces", "x" * 3000]:
    assert ask(c, word) == word.upper() + "\n", word
c[0].close()
print("ok")
