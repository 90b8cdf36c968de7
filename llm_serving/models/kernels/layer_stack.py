"""A model's decoder layers registered with the kernel library as one call (`LayerStack`; the library's
DecoderStack, kernels/layer_stack_cpu.h): each layer's DecoderLayer call (and a mixture's MoeMlp after it) with the
arrays the model holds for it, so that a graph runs every layer as one operator whose inputs are the step's and the
KV caches. A graph's compile time then no longer grows with the layers' weights (see layer_stack_cpu.h).

The library reads the registered arrays where they lie: this object keeps them alive, a LoRA write changes them
in place (LoraStack.write), and `replace` points a call at another array of the same shape (a matrix repacked after
the load: kernels/repack.py's LaterRepacks). The stack is released with this object.
"""
from __future__ import annotations

import ctypes
import weakref

from .signatures import DECODER_LAYER, MOE_MLP, KernelSignature

__all__ = ["HIDDEN", "LayerStack", "OUTPUT", "STACK_INPUTS", "cache_sources", "step_sources"]

# the stack call's parameters: the step's inputs (their indices are the sources a layer's call names), then each
# layer's key and value caches (from len(STACK_INPUTS) on, two a layer), then the stack's handle, then out
STACK_INPUTS = ("x", "positions", "slots", "block_tables", "context_lens", "tree_bits", "lora", "window_slots",
                "window_tables")
HELD, HIDDEN, OUTPUT = -1, -2, -3       # a call's parameter held, the running hidden state, the call's output
_KERNELS = {DECODER_LAYER.func: 0, MOE_MLP.func: 1}


class LayerStack:
    """The layers of one model in `library` (a kernel library's path), in order: `add(signature, sources, held)` per
    kernel call; `handle` names the stack in a DecoderStack call."""

    def __init__(self, library: str):
        lib = ctypes.CDLL(library)
        lib.StackCreate.restype = ctypes.c_int32
        lib.StackAddCall.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int32),
                                     ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p]
        lib.StackSetHeld.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]
        lib.StackRelease.argtypes = [ctypes.c_int32]
        self._lib = lib
        self.handle = int(lib.StackCreate())
        self.calls = 0
        self._arrays: dict = {}              # (call, parameter index) -> what the library reads: alive as the stack
        self._params: list = []              # per call, its signature's parameter names
        weakref.finalize(self, lib.StackRelease, self.handle)

    def add(self, signature: KernelSignature, sources: dict, held: dict) -> None:
        """One call of `signature`'s kernel: each of its call inputs from `sources` (name -> a STACK_INPUTS index, a
        cache's index, or HIDDEN), each held input from `held` (name -> array: its memory is read as it is, so the
        array must be contiguous in the kernel's dtype), the caches by `sources` too, and its output the next call's
        hidden state."""
        params = [p.name for p in signature.params]
        outputs = {p.name for p in signature.outputs}
        n = len(params)
        source = (ctypes.c_int32 * n)()
        ptrs = (ctypes.c_void_p * n)()
        ndims = (ctypes.c_int32 * n)()
        shapes = (ctypes.c_int64 * (4 * n))()
        dtypes = []
        for i, name in enumerate(params):
            if name in sources or name in outputs:
                source[i] = sources[name] if name in sources else OUTPUT
                dtypes.append("")
                continue
            array = held[name]
            if not array.flags["C_CONTIGUOUS"] or array.ndim > 4:
                raise ValueError(f"LayerStack: {signature.func}'s {name} must be a C-contiguous array of rank <= 4")
            source[i], ptrs[i], ndims[i] = HELD, array.ctypes.data, array.ndim
            for d, size in enumerate(array.shape):
                shapes[4 * i + d] = size
            dtypes.append(array.dtype.name)
            self._arrays[self.calls, i] = array
        rc = self._lib.StackAddCall(self.handle, _KERNELS[signature.func], n, source, ptrs, ndims, shapes,
                                    ",".join(dtypes).encode())
        if rc != 0:
            raise RuntimeError(f"LayerStack: the library refused {signature.func}'s call {self.calls} ({rc})")
        self._params.append(params)
        self.calls += 1

    def replace(self, call: int, name: str, array) -> None:
        """Call `call` (its index in the order added) reads its held input `name` from `array` from now on: the
        same shape and dtype as the array it replaces, C-contiguous; the old one is no longer kept. No stack call
        may run meanwhile (the caller's steps run on its own thread, between which it replaces)."""
        i = self._params[call].index(name)
        old = self._arrays[call, i]
        if array.shape != old.shape or array.dtype != old.dtype or not array.flags["C_CONTIGUOUS"]:
            raise ValueError(f"LayerStack.replace: {name} of call {call} is {old.dtype}{old.shape}; got "
                             f"{array.dtype}{array.shape}"
                             + ("" if array.flags["C_CONTIGUOUS"] else ", not contiguous"))
        if self._lib.StackSetHeld(self.handle, call, i, array.ctypes.data) != 0:
            raise RuntimeError(f"LayerStack.replace: the library refused {name} of call {call}")
        self._arrays[call, i] = array


def cache_sources(layer: int) -> dict:
    """A layer's key and value caches as the stack call's parameters."""
    at = len(STACK_INPUTS) + 2 * layer
    return {"key_cache": at, "value_cache": at + 1}


def step_sources(window_pool: bool) -> dict:
    """A DecoderLayer call's step inputs as the stack call's parameters: x the running hidden state; a layer whose
    K/V lie in the window pool reads the window slots and tables."""
    index = {name: i for i, name in enumerate(STACK_INPUTS)}
    return {"x": HIDDEN, "positions": index["positions"], "context_lens": index["context_lens"],
           "tree_bits": index["tree_bits"], "lora": index["lora"],
           "slots": index["window_slots" if window_pool else "slots"],
           "block_tables": index["window_tables" if window_pool else "block_tables"]}
