"""Calling a kernel library's function through ctypes exactly as MindSpore's AOT `ops.Custom` calls it (tests and
benchmarks, which run the kernels without MindSpore): `func(nparam, params, ndims, shapes, dtypes, stream, extra)`,
the inputs then the outputs, each as its data pointer, rank, shape and dtype name."""
from __future__ import annotations

import ctypes

__all__ = ["aot_args", "invoke"]


def aot_args(arrays: list) -> tuple:
    """(the call's ctypes arguments, what must stay alive while they are used) for numpy `arrays` (C-contiguous:
    the inputs, then the outputs). An entry may be (array, dtype name) for a type numpy lacks: ("bfloat16", its
    bits as uint16)."""
    names = [a[1] if isinstance(a, tuple) else str(a.dtype) for a in arrays]
    arrays = [a[0] if isinstance(a, tuple) else a for a in arrays]
    n = len(arrays)
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    shape_arrays = [(ctypes.c_int64 * max(a.ndim, 1))(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64))
                                                    for s in shape_arrays])
    dtypes = (ctypes.c_char_p * n)(*[name.encode() for name in names])
    return (ctypes.c_int(n), params, ndims, shapes, dtypes, None, None), (arrays, shape_arrays)


def invoke(func, arrays: list) -> int:
    """The kernel function's return code for one call on `arrays` (0: done; see the kernel's return codes)."""
    args, _alive = aot_args(arrays)
    return func(*args)
