#!/bin/bash
cat > /app/mywc.c <<'C'
#include <ctype.h>
#include <stdio.h>

int main(void) {
    long long lines = 0, words = 0, bytes = 0;
    int c, in_word = 0;
    while ((c = getchar()) != EOF) {
        bytes++;
        if (c == '\n')
            lines++;
        if (isspace(c)) {
            in_word = 0;
        } else if (!in_word) {
            in_word = 1;
            words++;
        }
    }
    printf("%lld %lld %lld\n", lines, words, bytes);
    return 0;
}
C
gcc -O2 -o /app/mywc /app/mywc.c
