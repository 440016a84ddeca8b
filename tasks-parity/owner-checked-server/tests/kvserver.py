"""A key-value server that checks its data directory as PostgreSQL does: owned by the user running it,
mode 0700, else it refuses to start."""

import http.server
import json
import os
import stat
import sys

data_dir, port = sys.argv[1], int(sys.argv[2])
st = os.stat(data_dir)
if st.st_uid != os.geteuid():
    sys.exit(f'data directory "{data_dir}" has wrong ownership (owner {st.st_uid}, server runs as {os.geteuid()})')
if stat.S_IMODE(st.st_mode) & 0o077:
    sys.exit(f'data directory "{data_dir}" has invalid permissions {oct(stat.S_IMODE(st.st_mode))}')
with open(os.path.join(data_dir, "kv.json")) as f:
    store = json.load(f)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        value = store.get(self.path.lstrip("/"))
        body = (value if isinstance(value, str) else "").encode()
        self.send_response(200 if value is not None else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
