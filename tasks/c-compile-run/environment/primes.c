#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s LIMIT\n", argv[0]);
        return 2;
    }
    long limit = strtol(argv[1], NULL, 10);
    for (long n = 2; n < limit; n++) {
        int prime = 1;
        for (long d = 2; d * d <= n; d++) {
            if (n % d == 0) {
                prime = 0;
                break;
            }
        }
        if (prime)
            printf("%ld\n", n);
    }
    return 0;
}
