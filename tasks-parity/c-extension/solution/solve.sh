#!/bin/bash
set -e
mkdir -p /app/fastsum && cd /app/fastsum
cat > fastsum.c <<'C'
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *total(PyObject *self, PyObject *args) {
    PyObject *items, *it, *item;
    long long sum = 0;
    if (!PyArg_ParseTuple(args, "O", &items) || !(it = PyObject_GetIter(items))) return NULL;
    while ((item = PyIter_Next(it))) {
        sum += PyLong_AsLongLong(item);
        Py_DECREF(item);
        if (PyErr_Occurred()) break;
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? NULL : PyLong_FromLongLong(sum);
}

static PyMethodDef methods[] = {{"total", total, METH_VARARGS, "The sum of some integers."}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastsum", NULL, -1, methods};
PyMODINIT_FUNC PyInit_fastsum(void) { return PyModule_Create(&module); }
C
cat > setup.py <<'PY'
from setuptools import Extension, setup

setup(name="fastsum", version="1.0", ext_modules=[Extension("fastsum", ["fastsum.c"])])
PY
python3 setup.py build_ext --inplace
cp fastsum*.so "$(python3 -c 'import site; print(site.getsitepackages()[0])')/"
cd / && python3 -c 'import fastsum; assert fastsum.total([1, 2, 3]) == 6'
