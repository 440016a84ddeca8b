#!/bin/bash
awk '$2 > 200 { print $1 }' /app/squares.txt > /app/big.txt
