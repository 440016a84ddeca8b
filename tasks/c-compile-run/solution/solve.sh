#!/bin/bash
gcc -O2 -o /app/primes /app/primes.c && /app/primes 100 > /app/primes_100.txt
