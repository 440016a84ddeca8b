#!/bin/bash
python -c 'import wordstats; print(wordstats.most_common(open("/app/text.txt").read()))' > /app/answer.txt
