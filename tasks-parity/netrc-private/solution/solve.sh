#!/bin/bash
set -e
printf 'machine files.example.com login deploy password s3cret\n' > /root/.netrc
chmod 600 /root/.netrc
