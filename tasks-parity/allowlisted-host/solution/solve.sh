#!/bin/bash
curl -fsS -m 60 -o /app/Release http://deb.debian.org/debian/dists/bookworm/Release
