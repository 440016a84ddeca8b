#!/bin/bash
sed -i 's/return (s\[mid\] + s\[mid + 1\]) \/ 2/return (s[mid - 1] + s[mid]) \/ 2/' /app/stats.py
