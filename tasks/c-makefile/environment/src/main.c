#include <stdio.h>

#include "vec.h"

int main(void) {
    vec a = {3, 4}, b = {1, -2};
    vec s = vec_add(a, b);
    printf("sum %.1f %.1f\n", s.x, s.y);
    printf("dot %.1f\n", vec_dot(a, b));
    printf("len %.1f\n", vec_len(a));
    return 0;
}
