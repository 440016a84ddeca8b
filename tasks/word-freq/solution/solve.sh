#!/bin/bash
tr -cs 'A-Za-z' '\n' < /app/book.txt | tr 'A-Z' 'a-z' | grep -v '^$' | sort | uniq -c | sort -rn | head -n 5 | awk '{print $2, $1}' > /app/top_words.txt
