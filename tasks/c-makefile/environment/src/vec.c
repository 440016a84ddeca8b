#include <math.h>

#include "vec.h"

vec vec_add(vec a, vec b) {
    vec r = {a.x + b.x, a.y + b.y};
    return r;
}

double vec_dot(vec a, vec b) { return a.x * b.x + a.y * b.y; }

double vec_len(vec a) { return sqrt(vec_dot(a, a)); }
