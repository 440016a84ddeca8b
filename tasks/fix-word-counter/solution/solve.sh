#!/bin/bash
sed -i -e 's/text.split(" ")/text.split()/' \
       -e 's/key=lambda kv: kv\[1\], reverse=True/key=lambda kv: (-kv[1], kv[0])/' /app/wordcount.py
