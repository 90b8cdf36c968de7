"""The CPU kernels' parameters by name: one declared list per kernel, from which the model builds the
`ops.Custom` call's argument tuple, and which the build checks against the kernel's own list.

A kernel's C++ source declares its parameters once (an X-macro list, kernel_params.h) in the order MindSpore
passes them (inputs, then outputs), with each one's rank and dtype; its enum of indices and the checks it runs
on every call come from that list, and the library exports it as text (`<Func>Params()`: "name:ndims:dtype,...").
`build_kernel` compares that text with the signature declared here and refuses a library whose list differs,
naming the first parameter that does (`KernelSignatureError`). A new kernel input is one line in the C++ list
and one here, at the same place; then its value by name: a step input is a new argument of the model's method
that runs the kernel (`check_call` holds it to the declared order), a held one a new keyword of `held(...)`.

dtype "weight": float32, or a GGUF type's stored bytes (uint8), which the kernel checks with the type code its
iconfig gives. dtype "cache": a KV cache, float32, float16, bfloat16 or int8 (pa_config.kv_cache_dtype), read from
the call.

A kernel's iconfig (its int32 settings: shapes, threads, type codes, switches) is declared the same way: its entries'
names in order, once in the C++ source (`<KERNEL>_ICONFIG`, exported as `<Func>Iconfig()`: "name,name,...") and
once here (`KernelSignature.iconfig`), compared by the build like the parameters; the model builds the array by
name (`iconfig_array`). What each entry means: the C++ list.
"""
from __future__ import annotations

import ctypes
import inspect
from dataclasses import dataclass

__all__ = ["DECODER_LAYER", "EMBED_TOKENS", "FINAL_LOGITS", "KERNEL_SIGNATURES", "MOE_MLP", "SAMPLE_LOGITS",
           "KernelParam", "KernelSignature", "KernelSignatureError", "check_iconfig", "check_library", "check_params"]


class KernelSignatureError(RuntimeError):
    """A kernel library's parameter list differs from the one the Python side calls it with: the .cc and
    signatures.py were changed apart. Not a build failure to fall back from: the code itself disagrees."""


@dataclass(frozen=True)
class KernelParam:
    name: str
    ndims: int
    dtype: str          # "float32", "int32", "weight" or "cache"

    def describe(self) -> str:
        return f"{self.name}:{self.ndims}:{self.dtype}"


@dataclass(frozen=True)
class KernelSignature:
    """A kernel's parameters in the order MindSpore passes them: the inputs a step gives (`call_inputs`, the
    arguments of the model's method that runs the kernel), then those the model holds (`held_inputs`: weights,
    caches, config), then the `outputs` (allocated by MindSpore). The order of the held ones is settled once, in
    Python, when the model is built (`held`): a graph's construct only forwards its own arguments and that
    tuple, since a name-to-position mapping inside a compiled graph costs ~1 s of compile time per call."""

    func: str
    call_inputs: tuple
    held_inputs: tuple
    outputs: tuple
    iconfig: tuple = ()     # the names of its iconfig's entries, in order

    @property
    def inputs(self) -> tuple:
        return self.call_inputs + self.held_inputs

    @property
    def input_names(self) -> tuple:
        return tuple(p.name for p in self.inputs)

    @property
    def params(self) -> tuple:
        return self.inputs + self.outputs

    def index(self, name: str) -> int:
        """The position of parameter `name` among the kernel's parameters (inputs, then outputs)."""
        return [p.name for p in self.params].index(name)

    def iconfig_index(self, name: str) -> int:
        """The position of entry `name` in the kernel's iconfig."""
        if name not in self.iconfig:
            raise KeyError(f"{self.func}'s iconfig has no entry {name!r} (these: {', '.join(self.iconfig)})")
        return self.iconfig.index(name)

    def iconfig_array(self, **values) -> "np.ndarray":
        """The kernel's iconfig, int32, from values given by name (every entry, nothing else)."""
        import numpy as np      # (here: the kernels' build, which imports this module, runs before numpy is installed)

        return np.array(_ordered(f"{self.func}'s iconfig", self.iconfig, values, "entry"), np.int32)

    def args(self, **values) -> tuple:
        """All the kernel's inputs in its order, from values given by name (every input, nothing else)."""
        return _ordered(self.func, self.input_names, values)

    def held(self, **values) -> tuple:
        """The held inputs in the kernel's order, from values given by name (every held input, nothing else): the
        tuple the model passes after a step's inputs."""
        return _ordered(self.func, tuple(p.name for p in self.held_inputs), values)

    def check_call(self, method) -> None:
        """TypeError unless `method` (the model's, that runs the kernel) takes exactly the call inputs, by their
        names and in their order: it forwards them as it takes them."""
        have = [n for n in inspect.signature(method).parameters if n != "self"]
        want = [p.name for p in self.call_inputs]
        if have != want:
            i = next(i for i, (h, w) in enumerate(zip(have + [None] * len(want), want + [None] * len(have)))
                     if h != w)
            raise TypeError(f"{method.__qualname__} takes {have} but {self.func}'s step inputs are {want}: "
                            f"argument {i} should be {want[i] if i < len(want) else None!r}, not "
                            f"{have[i] if i < len(have) else None!r}")


def _ordered(func: str, names: tuple, values: dict, kind: str = "input") -> tuple:
    missing = [n for n in names if n not in values]
    if missing:
        raise TypeError(f"{func}: no value for its {kind} {missing[0]!r}")
    unknown = [n for n in values if n not in names]
    if unknown:
        raise TypeError(f"{func}: it has no {kind} named {unknown[0]!r} here (these: {', '.join(names)})")
    return tuple(values[n] for n in names)


def _p(name: str, ndims: int, dtype: str) -> KernelParam:
    return KernelParam(name, ndims, dtype)


# decoder_layer_cpu.cc's DecoderLayer (its header comment says what each one holds)
DECODER_LAYER = KernelSignature(
    "DecoderLayer",
    call_inputs=(_p("x", 2, "float32"), _p("positions", 1, "int32"), _p("slots", 1, "int32"),
                 _p("block_tables", 2, "int32"), _p("context_lens", 1, "int32"), _p("tree_bits", 1, "int32"),
                 _p("cos", 2, "float32"), _p("sin", 2, "float32"), _p("lora", 1, "int32")),
    held_inputs=(_p("q_w", 2, "weight"), _p("k_w", 2, "weight"), _p("v_w", 2, "weight"),
                 _p("qkv_bias", 1, "float32"), _p("o_w", 2, "weight"), _p("o_bias", 1, "float32"), _p("gate_w", 2, "weight"),
                 _p("up_w", 2, "weight"), _p("down_w", 2, "weight"), _p("input_gain", 1, "float32"),
                 _p("post_gain", 1, "float32"), _p("q_norm", 1, "float32"), _p("k_norm", 1, "float32"),
                 _p("attn_out_gain", 1, "float32"), _p("mlp_out_gain", 1, "float32"), _p("sinks", 1, "float32"),
                 _p("gate_up_bias", 1, "float32"), _p("down_bias", 1, "float32"), _p("norm_bias", 2, "float32"),
                 _p("key_cache", 2, "cache"),
                 _p("value_cache", 2, "cache"),
                 _p("lora_qkv_a", 3, "float32"), _p("lora_qkv_b", 3, "float32"), _p("lora_o_a", 3, "float32"),
                 _p("lora_o_b", 3, "float32"), _p("lora_gate_up_a", 3, "float32"),
                 _p("lora_gate_up_b", 3, "float32"), _p("lora_down_a", 3, "float32"),
                 _p("lora_down_b", 3, "float32"), _p("iconfig", 1, "int32"), _p("fconfig", 1, "float32")),
    outputs=(_p("out", 2, "float32"),),
    iconfig=("block_size", "num_heads", "num_kv_heads", "threads", "q_type", "k_type", "v_type", "o_type", "gate_type",
             "up_type", "down_type", "batch_invariant", "activation", "qk_norm", "sandwich_norms", "window", "mlp",
             "attention_sinks", "norm", "post_norms", "gated_mlp", "mlp_biases"))

# decoder_layer_cpu.cc's FinalLogits
FINAL_LOGITS = KernelSignature(
    "FinalLogits",
    call_inputs=(_p("x", 2, "float32"), _p("slots", 1, "int32")),
    held_inputs=(_p("lm_head", 2, "weight"), _p("gain", 1, "float32"), _p("iconfig", 1, "int32"),
                 _p("fconfig", 1, "float32")),
    outputs=(_p("logits", 2, "float32"), _p("token", 1, "int32"), _p("logprob", 1, "float32")),
    iconfig=("threads", "lm_head_type", "batch_invariant"))

# decoder_layer_cpu.cc's MoeMlp: a mixture-of-experts layer's MLP, after its DecoderLayer without one
MOE_MLP = KernelSignature(
    "MoeMlp",
    call_inputs=(_p("x", 2, "float32"), _p("slots", 1, "int32")),
    held_inputs=(_p("router", 2, "float32"), _p("router_bias", 1, "float32"), _p("gate_w", 2, "weight"),
                 _p("up_w", 2, "weight"), _p("down_w", 2, "weight"), _p("gate_bias", 1, "float32"),
                 _p("up_bias", 1, "float32"), _p("down_bias", 1, "float32"), _p("post_gain", 1, "float32"),
                 _p("iconfig", 1, "int32"), _p("fconfig", 1, "float32")),
    outputs=(_p("out", 2, "float32"),),
    iconfig=("threads", "experts_per_token", "gate_type", "up_type", "down_type", "renormalize", "activation"))

# decoder_layer_cpu.cc's EmbedTokens: the embedding's rows read from the table as stored
EMBED_TOKENS = KernelSignature(
    "EmbedTokens",
    call_inputs=(_p("ids", 1, "int32"),),
    held_inputs=(_p("table", 2, "weight"), _p("iconfig", 1, "int32")),
    outputs=(_p("out", 2, "float32"),),
    iconfig=("table_type",))

# decoder_layer_cpu.cc's SampleLogits: sampler.py's temperature-only Sampler as one kernel
SAMPLE_LOGITS = KernelSignature(
    "SampleLogits",
    call_inputs=(_p("logits", 2, "float32"), _p("temperature", 1, "float32"), _p("random_u", 1, "float32")),
    held_inputs=(_p("iconfig", 1, "int32"),),
    outputs=(_p("token", 1, "int32"), _p("logprob", 1, "float32")),
    iconfig=("threads",))

# kernel source -> the signatures its library is checked against when built
KERNEL_SIGNATURES = {"decoder_layer_cpu": (DECODER_LAYER, FINAL_LOGITS, MOE_MLP, EMBED_TOKENS, SAMPLE_LOGITS)}


def check_params(signature: KernelSignature, compiled: str, source: str = "the kernel library") -> None:
    """KernelSignatureError naming the first parameter where `compiled` (a library's "name:ndims:dtype,..."
    list) and `signature` differ."""
    have = [p for p in compiled.split(",") if p]
    want = [p.describe() for p in signature.params]
    have_names, want_names = [p.split(":")[0] for p in have], [p.name for p in signature.params]
    where = f"{source}: {signature.func}"
    for i in range(max(len(have), len(want))):
        h, w = (have[i] if i < len(have) else None), (want[i] if i < len(want) else None)
        if h == w:
            continue
        if w is not None and want_names[i] not in have_names:
            problem = f"{want_names[i]!r} (parameter {i} in kernels/signatures.py) is missing from the C++ list"
        elif h is not None and have_names[i] not in want_names:
            problem = f"{have_names[i]!r} (parameter {i} in the C++ list) is missing from kernels/signatures.py"
        elif h is not None and w is not None and have_names[i] == want_names[i]:
            problem = f"parameter {i} is {h!r} in the C++ list but {w!r} in kernels/signatures.py"
        else:
            problem = (f"parameter {i} is {have_names[i] if h else None!r} in the C++ list but "
                       f"{want_names[i] if w else None!r} in kernels/signatures.py (the order differs)")
        raise KernelSignatureError(f"{where}: {problem}; the two lists must name the same parameters in the "
                                   "same order")


def check_iconfig(signature: KernelSignature, compiled: str, source: str = "the kernel library") -> None:
    """KernelSignatureError naming the first entry where `compiled` (a library's "name,name,..." iconfig list) and
    `signature.iconfig` differ."""
    have, want = [n for n in compiled.split(",") if n], list(signature.iconfig)
    for i in range(max(len(have), len(want))):
        h, w = (have[i] if i < len(have) else None), (want[i] if i < len(want) else None)
        if h == w:
            continue
        if w is not None and w not in have:
            problem = f"{w!r} (entry {i} in kernels/signatures.py) is missing from the C++ list"
        elif h is not None and h not in want:
            problem = f"{h!r} (entry {i} in the C++ list) is missing from kernels/signatures.py"
        else:
            problem = f"entry {i} is {h!r} in the C++ list but {w!r} in kernels/signatures.py (the order differs)"
        raise KernelSignatureError(f"{source}: {signature.func}'s iconfig: {problem}; the two lists must name the "
                                   "same entries in the same order")


def _exported_text(lib, name: str, what: str, source: str) -> str:
    try:
        describe = getattr(lib, name)
    except AttributeError:
        raise KernelSignatureError(f"{source} exports no {name}(): its {what} cannot be checked against "
                                   "kernels/signatures.py") from None
    describe.restype = ctypes.c_char_p
    describe.argtypes = []
    return describe().decode()


def check_library(path: str, signatures, source: str = "the kernel library") -> None:
    """Check each signature against the parameter list (and iconfig list, where it declares one) the library at
    `path` exports for it."""
    lib = ctypes.CDLL(str(path))
    for sig in signatures:
        check_params(sig, _exported_text(lib, f"{sig.func}Params", "parameters", source), source)
        if sig.iconfig:
            check_iconfig(sig, _exported_text(lib, f"{sig.func}Iconfig", "iconfig", source), source)
