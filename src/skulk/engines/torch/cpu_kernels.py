"""Our AVX2 kernels (cpu_matmul.c, cpu_step.c, cpu_moe.c), compiled on first use and called through ctypes.

torch's CPU matmuls are fast for f16 weights one row at a time only, slow for bf16 weights at any row count
below a GEMM's, and its weight-only int4/int8 kernels want bf16 activations and reach about a third of the
memory bandwidth llama.cpp's do (bench/engine.py). Decode is a few rows against every weight, so it is
bandwidth: these kernels stream each weight byte once per step, widen f16/bf16 or unpack MLX's 4/8-bit groups
as they go, and handle up to eight rows per pass, so a batched step costs about what a single one does.

The C files need no torch or Python headers: gcc builds them into one library in 3-5 seconds, in the
user's cache directory (keyed by the sources' hash and the flags, written atomically so concurrent processes
agree), with VNNI, AVX-512 BF16 and AMX where the CPU has them (extension_flags; AMX also needs Linux's leave,
asked once per process, and is off with SKULK_AMX=0). It is
loaded after torch, so it shares torch's OpenMP runtime and thread count. Where there is no AVX2/FMA/F16C CPU
or no C compiler, available() is False and the engine uses torch's kernels instead: slower, the same results
within rounding (tests/unit/test_cpu_kernels.py compares the two paths).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .device import uses_c_kernels

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_matmul.c", "cpu_step.c", "cpu_amx.c", "cpu_moe.c"))
HEADER = Path(__file__).with_name("cpu_kernels.h")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_GROUP = 256
"""The largest quantization group the quantized kernel takes (quant.SUPPORTED_GROUPS' largest; its int16 sums
are widened every 64 columns, so the group size itself is not what bounds it)."""


def cache_dir() -> Path:
    """Where the built library is kept, one file per source version: a build cache, not state."""
    return Path.home() / ".cache" / "skulk" / "kernels"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def _cpu_ok() -> bool:
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def extension_flags() -> tuple[str, ...]:
    """gcc flags for what this CPU has beyond AVX2 that the kernels use, empty where it has none or while switched
    off. VNNI (AVX-512 VNNI with VL: Zen 4, Ice Lake servers and later; AVX-VNNI: Alder Lake and later): the
    quantized kernels multiply-add with vpdpbusd, half the vector ops of maddubs + add, which bound a batched step.
    AVX-512 BF16 (Zen 4, Cooper Lake and later): bf16 weights against bf16 activations with vdpbf16ps."""
    if not _extensions:
        return ()
    flags = cpu_flags()
    if {"avx512_vnni", "avx512vl"} <= flags:  # 256-bit vectors still: the kernels' layouts are built for them
        bf16 = ("-mavx512bf16",) if "avx512_bf16" in flags else ()
        return ("-mavx512vnni", "-mavx512vl", *bf16, "-mprefer-vector-width=256", *amx_flags())
    if "avx_vnni" in flags:
        return ("-mavxvnni",)
    return ()


def amx_flags() -> tuple[str, ...]:
    """gcc flags for AMX-INT8 tiles (cpu_amx.c: the quantized matmul for many rows), where the CPU has them; built
    only beside AVX-512 VNNI (extension_flags), whose kernels it must match bit for bit."""
    return ("-mamx-tile", "-mamx-int8") if {"amx_tile", "amx_int8"} <= cpu_flags() else ()


AMX_ROWS = 16
"""The fewest activation rows that take the AMX kernel (cpu_amx.c) where it runs."""


def _enable_amx(lib: ctypes.CDLL) -> None:
    """Ask Linux for AMX's tile state (once per process) where the library has the AMX kernel, unless SKULK_AMX=0;
    where it is refused the VNNI kernels serve every row count."""
    enable = getattr(lib, "skulk_amx_enable", None)
    if enable is None or os.environ.get("SKULK_AMX", "1") == "0":
        return
    enable.argtypes, enable.restype = [ctypes.c_int], ctypes.c_int
    if not enable(AMX_ROWS):
        log.info("AMX tiles refused by the kernel (arch_prctl): the VNNI kernels serve every row count")


def amx_rows(rows: int | None = None) -> int:
    """The fewest activation rows that take the AMX kernel: 0 where it does not run (no AMX build, permission
    refused, SKULK_AMX=0). With `rows` (where it runs): set it, 1 << 30 for never (bench and tests compare the two
    paths in one process). Returns the value before."""
    lib = library()
    if lib is None:
        return 0
    value = ctypes.c_int.in_dll(lib, "skulk_amx_rows")
    before = value.value
    if rows is not None and before:
        value.value = rows
    return before


def _build(extra: tuple[str, ...]) -> Path:
    source = b"".join(path.read_bytes() for path in (HEADER, *SOURCES))
    flags = (*FLAGS, *extra)
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise OSError("no C compiler (gcc or cc) on PATH")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built)], check=True, capture_output=True,
                       timeout=120)
        os.replace(built, target)
    return target


class MatrixDesc(ctypes.Structure):
    """cpu_step.c's matrix_t: a HalfMatrix (kind 0) or QuantMatrix (kind 1) as skulk_decode_layer reads it."""

    _fields_ = [("kind", ctypes.c_int), ("wtype", ctypes.c_int), ("bits", ctypes.c_int), ("group", ctypes.c_int),
                ("n", ctypes.c_int), ("k", ctypes.c_int), ("w", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("biases", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class LayerDesc(ctypes.Structure):
    """cpu_step.c's layer_t: one decoder layer's matrices, norms and shape."""

    _fields_ = [("qkv", MatrixDesc), ("o", MatrixDesc), ("gate_up", MatrixDesc), ("down", MatrixDesc),
                ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("norm_type", ctypes.c_int), ("heads", ctypes.c_int),
                ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("hidden", ctypes.c_int),
                ("inter", ctypes.c_int), ("gelu", ctypes.c_int), ("unit_offset", ctypes.c_int),
                ("eps", ctypes.c_float), ("qk_eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("moe", ctypes.c_void_p)]
    """moe: a MoeDesc's address (MoeKernel.address) when the layer's MLP is a sparse MoE block, else None."""


class MoeDesc(ctypes.Structure):
    """cpu_kernels.h's moe_t: a sparse MoE block's router and its experts' stacked gate/up and down matrices."""

    _fields_ = [("router", MatrixDesc), ("gate_up", ctypes.POINTER(MatrixDesc)), ("down", ctypes.POINTER(MatrixDesc)),
                ("experts", ctypes.c_int), ("top_k", ctypes.c_int), ("inter", ctypes.c_int), ("hidden", ctypes.c_int),
                ("normalize", ctypes.c_int)]


_enabled = True
_extensions = True


def set_enabled(enabled: bool, *, extensions: bool = True) -> None:
    """Switch the kernels off (torch's ops everywhere) or back on, for models loaded from then on, with or without
    the CPU's extensions beyond AVX2 (extension_flags): tests compare the paths with it."""
    global _enabled, _extensions
    _enabled, _extensions = enabled, extensions
    library.cache_clear()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run here (the reason is logged once)."""
    if not _enabled:
        return None
    if not _cpu_ok():
        log.info("cpu kernels off: this CPU lacks AVX2, FMA or F16C")
        return None
    lib = None
    extensions = extension_flags()
    without_amx = tuple(flag for flag in extensions if flag not in amx_flags())
    for extra in dict.fromkeys((extensions, without_amx, ())):  # a gcc too old for those builds without them
        try:
            lib = ctypes.CDLL(str(_build(extra)))
            break
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")[-500:]
            log.warning("cpu kernels with flags %s failed to build: %s %s", extra or "(AVX2 only)", exc, detail)
    if lib is None:
        log.warning("cpu kernels off, torch's are used instead")
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.skulk_half_mv.argtypes = [ptr, i32, i32, i32, ptr, i32, i32, ptr, ptr, i32]
    lib.skulk_half_mv.restype = None
    lib.skulk_quant_mv.argtypes = [ptr, ptr, ptr, i32, i32, i32, i32, ptr, i32, i32, ptr, ptr, i32]
    lib.skulk_quant_mv.restype = None
    lib.skulk_rms_norm.argtypes = [ptr, i32, i32, i32, ptr, i32, ctypes.c_float, i32, ptr]
    lib.skulk_rms_norm.restype = None
    lib.skulk_decode_attention.argtypes = [ptr, ptr, ptr, i32, i32, i32, i32, i32, ptr, ptr, i32, i32, i32,
                                           ctypes.c_float, ptr]
    lib.skulk_decode_attention.restype = None
    lib.skulk_qkv_rope.argtypes = [ptr, i32, i32, i32, i32, i32, ptr, ptr, ptr, ptr, ctypes.c_float, i32, ptr, ptr, i32,
                                   i32, ptr, ptr, ptr]
    lib.skulk_qkv_rope.restype = None
    lib.skulk_add_rms_norm.argtypes = [ptr, ptr, i32, i32, i32, ptr, i32, ctypes.c_float, i32, ptr, ptr]
    lib.skulk_add_rms_norm.restype = None
    lib.skulk_act_mul.argtypes = [ptr, i32, i32, i32, i32, ptr]
    lib.skulk_act_mul.restype = None
    lib.skulk_decode_layer.argtypes = [ctypes.POINTER(LayerDesc), ptr, ptr, i32, i32, ptr, ptr, i32, i32, ptr, ptr, i32,
                                       ptr, ptr]
    lib.skulk_decode_layer.restype = None
    lib.skulk_decode_layers.argtypes = [ptr, i32, ptr, ptr, ptr, i32, i32, ptr, ptr, i32, i32, ptr, ptr, ptr, ptr, ptr]
    lib.skulk_decode_layers.restype = None
    lib.skulk_moe_mix.argtypes = [ctypes.POINTER(MoeDesc), ptr, i32, i32, ptr, ptr, ptr]
    lib.skulk_moe_mix.restype = None
    lib.skulk_moe.argtypes = [ctypes.POINTER(MoeDesc), ptr, i32, i32, ptr]
    lib.skulk_moe.restype = None
    _enable_amx(lib)
    return lib


def available() -> bool:
    return library() is not None


def type_code(dtype: torch.dtype) -> int:
    """cpu_kernels.h's code for a dtype (T_F32, T_F16, T_BF16)."""
    return _TYPES[dtype]


def handles(x: torch.Tensor) -> bool:
    """True when x (activations) is a CPU tensor in a dtype the kernels read and write (device.uses_c_kernels: on
    CUDA every caller takes torch's op-by-op path instead, the C layer stack included)."""
    return uses_c_kernels(x.device) and x.dtype in _TYPES


class HalfMatrix:
    """An f16/bf16/f32 weight (and optional bias) resolved once for skulk_half_mv: pointers and sizes, bias as f32. The
    module that owns the weight keeps one and rebuilds it if its weight tensor is replaced."""

    __slots__ = ("args", "bias", "k", "n", "source", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.source = weight
        self.weight = weight.contiguous()
        self.bias = bias.detach().float().contiguous() if bias is not None else None
        self.n, self.k = self.weight.shape
        self.args = (self.weight.data_ptr(), _TYPES[weight.dtype], self.n, self.k)

    def describe(self) -> MatrixDesc:
        bias = self.bias.data_ptr() if self.bias is not None else None
        return MatrixDesc(0, self.args[1], 0, 0, self.n, self.k, self.args[0], None, None, bias)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] @ weight.T (+ bias); out in out_dtype (else x's)."""
        lib = library()
        assert lib is not None
        x = x.contiguous()
        out = torch.empty((*x.shape[:-1], self.n), dtype=out_dtype or x.dtype)
        lib.skulk_half_mv(*self.args, x.data_ptr(), _TYPES[x.dtype], x.numel() // self.k,
                          self.bias.data_ptr() if self.bias is not None else None, out.data_ptr(), _TYPES[out.dtype])
        return out


class QuantMatrix:
    """A matrix in our quantized layout (quant.interleave8: bytes and f16 scales and biases interleaved in blocks of 8
    rows, for 8 bits values stored as q - 128 with the 128 folded into biases) with n output rows, resolved once for
    skulk_quant_mv."""

    __slots__ = ("args", "bias", "k", "n", "tensors")

    def __init__(self, packed: torch.Tensor, params: torch.Tensor, bits: int, group: int,
                 bias: torch.Tensor | None, n: int) -> None:
        self.tensors = (packed.contiguous(), params.contiguous())
        self.n, self.k = n, params.shape[2] * group
        self.bias = bias.detach().float().contiguous() if bias is not None else None
        scales, biases = self.tensors[1][0], self.tensors[1][1]
        self.args = (self.tensors[0].data_ptr(), scales.data_ptr(), biases.data_ptr(), bits, group, self.n, self.k)

    def describe(self) -> MatrixDesc:
        weight, scales, biases, bits, group, n, k = self.args
        bias = self.bias.data_ptr() if self.bias is not None else None
        return MatrixDesc(1, 0, bits, group, n, k, weight, scales, biases, bias)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        lib = library()
        assert lib is not None
        x = x.contiguous()
        out = torch.empty((*x.shape[:-1], self.n), dtype=out_dtype or x.dtype)
        lib.skulk_quant_mv(*self.args, x.data_ptr(), _TYPES[x.dtype], x.numel() // self.k,
                           self.bias.data_ptr() if self.bias is not None else None, out.data_ptr(), _TYPES[out.dtype])
        return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """layers.RMSNorm's arithmetic (f32 inside, the same roundings) in one call instead of a dozen ops."""
    lib = library()
    assert lib is not None
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    lib.skulk_rms_norm(x.data_ptr(), _TYPES[x.dtype], x.numel() // n, n, weight.data_ptr(), _TYPES[weight.dtype], eps,
                       int(unit_offset), out.data_ptr())
    return out


def _tables(tables: torch.Tensor) -> torch.Tensor:
    """Block tables as the kernels read them: int32, rows contiguous."""
    return tables if tables.dtype == torch.int32 and tables.is_contiguous() else tables.to(torch.int32).contiguous()


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     tables: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """One query per row against its cached keys: q [B, H, 1, D]; keys/values a layer's paged cache [blocks, Hkv,
    block_size, D]; positions [B, 1] (the query's position: it sees keys up to it, and only the last `window` of
    them when window > 0); tables [B, n] each row's block table. Returns [B, H, 1, D] as scaled_dot_product_attention
    would."""
    lib = library()
    assert lib is not None
    b, h, _, d = q.shape
    q, positions, tables = q.contiguous(), positions.to(torch.int64).contiguous(), _tables(tables)
    out = torch.empty_like(q)
    lib.skulk_decode_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), _TYPES[q.dtype], b, h, keys.shape[1],
                               d, positions.data_ptr(), tables.data_ptr(), tables.shape[1], keys.shape[2], window,
                               scale, out.data_ptr())
    return out


def qkv_rope(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, rope: tuple[torch.Tensor, torch.Tensor],
             norms: tuple[torch.Tensor, torch.Tensor] | None, eps: float, unit_offset: bool, positions: torch.Tensor,
             tables: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A decode step's attention inputs in one call: from the stacked projection's output qkv [B, 1, (H + 2 Hkv) D],
    per-head q/k norms (norms: their weights, if the model has them), rope (cos and sign-folded sin [B, 1, 1, D]),
    k and v stored at each row's position of the paged cache through its block table; returns the rotated q
    [B, H, 1, D]."""
    lib = library()
    assert lib is not None
    b = qkv.shape[0]
    qkv, positions, tables = qkv.contiguous(), positions.to(torch.int64).contiguous(), _tables(tables)
    cos, sin = rope[0].contiguous(), rope[1].contiguous()
    q = torch.empty((b, heads, 1, head_dim), dtype=qkv.dtype)
    q_norm, k_norm = (norms[0].data_ptr(), norms[1].data_ptr()) if norms is not None else (None, None)
    lib.skulk_qkv_rope(qkv.data_ptr(), _TYPES[qkv.dtype], b, heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                       q_norm, k_norm, eps, int(unit_offset), positions.data_ptr(), tables.data_ptr(), tables.shape[1],
                       keys.shape[2], keys.data_ptr(), values.data_ptr(), q.data_ptr())
    return q


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) for h = x + delta: a layer's residual add and the norm after it, in one call."""
    lib = library()
    assert lib is not None
    x, delta = x.contiguous(), delta.contiguous()
    h, out = torch.empty_like(x), torch.empty_like(x)
    n = x.shape[-1]
    lib.skulk_add_rms_norm(x.data_ptr(), delta.data_ptr(), _TYPES[x.dtype], x.numel() // n, n, weight.data_ptr(),
                           _TYPES[weight.dtype], eps, int(unit_offset), h.data_ptr(), out.data_ptr())
    return h, out


def act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up for the stacked gate/up output [..., 2 I]: SiLU, or GELU's tanh approximation."""
    lib = library()
    assert lib is not None
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype)
    lib.skulk_act_mul(gate_up.data_ptr(), _TYPES[gate_up.dtype], gate_up.numel() // (2 * inter), inter, int(gelu),
                      out.data_ptr())
    return out


def decode_layer(desc: LayerDesc, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 window: int, tables: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A whole decoder layer for a decode step (x [B, 1, hidden]) in one call; keys/values: the layer's paged cache,
    tables: each row's block table. layers.DecoderLayer builds desc once and decides when this applies."""
    lib = library()
    assert lib is not None
    x, positions, tables = x.contiguous(), positions.to(torch.int64).contiguous(), _tables(tables)
    cos, sin = rope[0].contiguous(), rope[1].contiguous()
    out = torch.empty_like(x)
    lib.skulk_decode_layer(ctypes.byref(desc), x.data_ptr(), out.data_ptr(), _TYPES[x.dtype], x.shape[0],
                           positions.data_ptr(), tables.data_ptr(), tables.shape[1], keys.shape[2], cos.data_ptr(),
                           sin.data_ptr(), window, keys.data_ptr(), values.data_ptr())
    return out


class LayerStack:
    """A slice's layers described for skulk_decode_layers, with one cache's per-layer pointers: a decode step through
    every layer in one call. The pointers are valid while that cache lives: model.ModelSlice keeps one per cache
    (by weak reference) and builds another for a new cache."""

    __slots__ = ("block_size", "descs", "keys", "n", "values", "windows")

    def __init__(self, descs: list[LayerDesc], windows: list[int], keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> None:
        self.n = len(descs)
        self.descs = (LayerDesc * self.n)(*descs)
        self.windows = (ctypes.c_int * self.n)(*windows)
        self.keys = (ctypes.c_void_p * self.n)(*(k.data_ptr() for k in keys))
        self.values = (ctypes.c_void_p * self.n)(*(v.data_ptr() for v in values))
        self.block_size = keys[0].shape[2]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 tables: torch.Tensor) -> torch.Tensor:
        """x [B, 1, hidden] through every layer for a step of one token per row: row b at positions[b] through block
        table tables[b] (a prefill chunk's tokens are rows sharing their request's table: skulk_decode_layer)."""
        lib = library()
        assert lib is not None
        x, positions, tables = x.contiguous(), positions.to(torch.int64).contiguous(), _tables(tables)
        cos, sin = rope[0].contiguous(), rope[1].contiguous()
        out, tmp = torch.empty_like(x), torch.empty_like(x)
        lib.skulk_decode_layers(self.descs, self.n, x.data_ptr(), out.data_ptr(), tmp.data_ptr(), _TYPES[x.dtype],
                                x.shape[0], positions.data_ptr(), tables.data_ptr(), tables.shape[1], self.block_size,
                                cos.data_ptr(), sin.data_ptr(), self.windows, self.keys, self.values)
        return out


Matrix = HalfMatrix | QuantMatrix


class MoeKernel:
    """A sparse MoE block (moe.SparseMoe: softmax router, SiLU experts with stacked gate/up) described once for
    cpu_moe.c: its picked experts in one call (mix), or routing too (__call__), or as a part of a decoder layer's
    skulk_decode_layer call (LayerDesc.moe = address). Holds the matrices' descriptions; the matrices themselves
    stay the modules' (their tensors must outlive it, as the modules that build it keep them)."""

    __slots__ = ("any_rows", "desc", "down", "gate_up", "matrices", "routes")

    def __init__(self, router: Matrix | None, gate_up: list[Matrix], down: list[Matrix], top_k: int,
                 normalize: bool) -> None:
        """router: the softmax router's matrix, or None where routing runs elsewhere (then only mix runs)."""
        self.matrices = (router, gate_up, down)
        self.routes = router is not None
        self.any_rows = all(isinstance(m, QuantMatrix) or m.args[1] == _TYPES[torch.float32] for m in (*gate_up, *down))
        """Quantized or f32 experts: torch's path runs them on these kernels at any row count too (f16/bf16 ones
        turn to a GEMM from matmul.FLOAT_GEMM_ROWS rows, which a prefill should keep: SparseMoe.kernel_for)."""
        self.gate_up = (MatrixDesc * len(gate_up))(*(m.describe() for m in gate_up))
        self.down = (MatrixDesc * len(down))(*(m.describe() for m in down))
        hidden, inter = gate_up[0].k, down[0].k
        routing = router.describe() if router is not None else MatrixDesc()
        self.desc = MoeDesc(routing, self.gate_up, self.down, len(gate_up), top_k, inter, hidden, int(normalize))

    @property
    def address(self) -> int:
        return ctypes.addressof(self.desc)

    def mix(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]'s rows through their chosen experts (chosen [N, k]) times weights [N, k], summed:
        SparseMoe.mix's result and roundings."""
        lib = library()
        assert lib is not None
        x = x.contiguous()
        ids = chosen.to(torch.int32).contiguous()
        w = weights.float().contiguous()
        out = torch.empty_like(x)
        lib.skulk_moe_mix(ctypes.byref(self.desc), x.data_ptr(), _TYPES[x.dtype], x.shape[0], ids.data_ptr(),
                          w.data_ptr(), out.data_ptr())
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The whole block for x [N, hidden]: routing (SparseMoe.route's softmax top-k) and mix."""
        lib = library()
        assert lib is not None and self.routes
        x = x.contiguous()
        out = torch.empty_like(x)
        lib.skulk_moe(ctypes.byref(self.desc), x.data_ptr(), _TYPES[x.dtype], x.shape[0], out.data_ptr())
        return out
