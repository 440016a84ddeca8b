#!/bin/bash
awk '{ s += $2 } END { print s }' /app/counts.txt > /app/total.txt
