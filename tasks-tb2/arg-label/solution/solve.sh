#!/bin/bash
IFS=. read -r major minor _ < /app/VERSION
echo "$major.$((minor + 1)).0" > /app/NEXT_VERSION
