#ifndef VEC_H
#define VEC_H

typedef struct {
    double x, y;
} vec;

vec vec_add(vec a, vec b);
double vec_dot(vec a, vec b);
double vec_len(vec a);

#endif
