#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s N\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[1]);
    int total = 0;
    for (int i = 1; i < n; i++) {
        total += i * i;
    }
    printf("%d\n", total);
    return 0;
}
