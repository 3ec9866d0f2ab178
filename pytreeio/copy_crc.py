"""A copy that takes the CRC-32 (zlib's) of the bytes it moves, in one pass, compiled with llvmlite.

Checking a ZIP member's CRC-32 as it is read costs a second pass over its
bytes after the copy: on 2 cores, a load of page-cached ``.npz`` files ran at
0.65-0.71x of the raw read, when reads ran at memory speed.  Here the bytes a
loop loads to copy are folded into the CRC while in registers: the fold is
carry-less multiplication (``PCLMULQDQ``, or ``VPCLMULQDQ`` on 256-bit
registers where the CPU has it) of K accumulators by constants for their
distance, then of one accumulator by the constant for 16 bytes (Gopal et al.,
"Fast CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction",
Intel, 2009).  The folded 16 bytes have the message's CRC, which zlib
finishes over them and the last (< 16) bytes.

Layout of a :class:`CopyCrc` call's work on ``n`` bytes (``V`` = 16 or 32 bytes)::

    [K*V bytes: the accumulators' first values, the CRC's start value xored into
     the first 4 bytes] [K*V bytes folded at a time] ... [16-byte blocks] [< 16 bytes]

Only the first lane of the first register starts from the CRC value; the
copy's stores are ordinary (non-temporal ones measured slower on the page-cache
reads this serves, and need aligned destinations).

The kernel is compiled from LLVM IR by llvmlite (numba's code generator, in
the ``fast`` extra) on a background thread the first time a large copy asks
for it (:func:`use`, ~55 ms: llvmlite's import and one compile), and is used
once ready; :func:`ready` is false on CPUs without carry-less multiply,
where llvmlite is missing, with ``PYTREEIO_NO_NUMBA=1``, or if building it
failed.  Callers keep their read-then-hash path meanwhile.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import zlib
from collections.abc import Callable
from typing import Any

from .pools import Warming

__all__ = [
    "MIN_BYTES",
    "use",
    "ready",
    "build",
    "cpu_features",
    "kernel_ir",
    "CopyCrc",
]

#: Copies below this many bytes are not worth the kernel (callers copy and hash as before).
MIN_BYTES = 64 << 10

_POLY = 0x104C11DB7  # the CRC-32 polynomial, x^32 first
_build_lock = threading.Lock()  # held while building (callers of use() never take it)
_kernel: CopyCrc | None = None
_failed = False


def _xpow_mod(n: int) -> int:
    """x^n mod P over GF(2), P the CRC-32 polynomial (non-reflected)."""
    r = 1
    for _ in range(n):
        r <<= 1
        if r & (1 << 32):
            r ^= _POLY
    return r


def _fold_constant(bits: int) -> tuple[int, int]:
    """The (low, high) 64-bit multipliers that move a 128-bit accumulator ``bits`` bits on.

    Reflected, as the bytes lie: the low half is the earlier part of the message
    and goes ``bits + 32`` bits, the high half ``bits - 32`` (each constant is
    x^k mod P bit-reversed in 32 bits and shifted left by one).
    """

    def k(n: int) -> int:
        return int(format(_xpow_mod(n), "032b")[::-1], 2) << 1

    return k(bits + 32), k(bits - 32)


def kernel_ir(accumulators: int, wide: bool, opaque_pointers: bool = True) -> str:
    """LLVM IR of ``i64 copy_fold(ptr src, ptr dst, i64 n, i64 start, ptr out)``.

    Copies the whole 16-byte blocks of ``src[:n]`` to ``dst``, folding them
    into one 128-bit value stored at ``out``; returns the bytes done (``n``
    rounded down to 16).  ``start`` (the CRC register, ``~crc``) is xored into
    the first 4 bytes.  Needs ``n >= accumulators * (32 if wide else 16)``.
    ``opaque_pointers``: LLVM 17 on knows only ``ptr``; LLVM 15 and 16 (llvmlite
    0.44) parse typed pointers only (``i8*``, cast to the vector's pointer type).
    """
    lanes = 2 if wide else 1
    vec = f"<{2 * lanes} x i64>"
    xmm = "<2 x i64>"
    clmul = "llvm.x86.pclmulqdq.256" if wide else "llvm.x86.pclmulqdq"
    far_lo, far_hi = _fold_constant(128 * accumulators * lanes)
    near_lo, near_hi = _fold_constant(128)
    far = "<" + ", ".join([f"i64 {far_lo}, i64 {far_hi}"] * lanes) + ">"
    near = f"<i64 {near_lo}, i64 {near_hi}>"
    lines: list[str] = []
    emit = lines.append
    count = 0

    def fold(acc: str, constant: str, block: str, into: str, ty: str, fn: str) -> None:
        nonlocal count
        count += 1
        emit(f"  %lo{count} = call {ty} @{fn}({ty} {acc}, {ty} {constant}, i8 0)")
        emit(f"  %hi{count} = call {ty} @{fn}({ty} {acc}, {ty} {constant}, i8 17)")
        emit(f"  %mix{count} = xor {ty} %lo{count}, %hi{count}")
        emit(f"  {into} = xor {ty} %mix{count}, {block}")

    def pointer(ty: str) -> str:
        return "ptr" if opaque_pointers else f"{ty}*"

    def base(arg: str, ty: str) -> str:
        """``%arg`` as a pointer to ``ty``s."""
        return f"%{arg}" if opaque_pointers else f"%{arg}.{'v' if ty == vec else 'x'}"

    def copy(index: str, name: str, ty: str) -> None:
        p = pointer(ty)
        emit(f"  %from.{name} = getelementptr {ty}, {p} {base('src', ty)}, i64 {index}")
        emit(f"  %{name} = load {ty}, {p} %from.{name}, align 1")
        emit(f"  %to.{name} = getelementptr {ty}, {p} {base('dst', ty)}, i64 {index}")
        emit(f"  store {ty} %{name}, {p} %to.{name}, align 1")

    emit(f"declare {xmm} @llvm.x86.pclmulqdq({xmm}, {xmm}, i8)")
    if wide:
        emit(f"declare {vec} @{clmul}({vec}, {vec}, i8)")
    byte_pointer = pointer("i8")
    emit(
        f"define i64 @copy_fold({byte_pointer} %src, {byte_pointer} %dst, i64 %n, i64 %start,"
        f" {byte_pointer} %out) {{"
    )
    emit("entry:")
    if not opaque_pointers:
        for arg in ("src", "dst", "out"):
            for ty in dict.fromkeys((vec, xmm)):  # one type when narrow
                emit(f"  {base(arg, ty)} = bitcast i8* %{arg} to {ty}*")
    for i in range(accumulators):
        copy(str(i), f"first{i}", vec)
    emit(f"  %start.v = insertelement {vec} zeroinitializer, i64 %start, i32 0")
    emit(f"  %seed0 = xor {vec} %first0, %start.v")
    emit(f"  %blocks = udiv i64 %n, {16 * lanes}")
    emit("  br label %loop")
    emit("loop:")
    emit(f"  %i = phi i64 [{accumulators}, %entry], [%i.next, %body]")
    for a in range(accumulators):
        seed = "%seed0" if a == 0 else f"%first{a}"
        emit(f"  %acc{a} = phi {vec} [{seed}, %entry], [%next{a}, %body]")
    emit(f"  %i.next = add i64 %i, {accumulators}")
    emit("  %more = icmp ule i64 %i.next, %blocks")
    emit("  br i1 %more, label %body, label %reduce")
    emit("body:")
    for a in range(accumulators):
        emit(f"  %at{a} = add i64 %i, {a}")
        copy(f"%at{a}", f"block{a}", vec)
    for a in range(accumulators):
        fold(f"%acc{a}", far, f"%block{a}", f"%next{a}", vec, clmul)
    emit("  br label %loop")
    # the accumulators' 16-byte lanes, in message order, folded into one
    emit("reduce:")
    parts: list[str] = []
    for a in range(accumulators):
        if wide:
            emit(
                f"  %acc{a}.0 = shufflevector {vec} %acc{a}, {vec} poison, <2 x i32> <i32 0, i32 1>"
            )
            emit(
                f"  %acc{a}.1 = shufflevector {vec} %acc{a}, {vec} poison, <2 x i32> <i32 2, i32 3>"
            )
            parts += [f"%acc{a}.0", f"%acc{a}.1"]
        else:
            parts.append(f"%acc{a}")
    value = parts[0]
    for k, part in enumerate(parts[1:]):
        fold(value, near, part, f"%red{k}", xmm, "llvm.x86.pclmulqdq")
        value = f"%red{k}"
    emit(f"  %done16 = mul i64 %i, {lanes}")
    emit("  %blocks16 = lshr i64 %n, 4")
    emit("  br label %rest")
    # the 16-byte blocks after the last whole group of K registers
    emit("rest:")
    emit("  %j = phi i64 [%done16, %reduce], [%j.next, %rest.body]")
    emit(f"  %acc = phi {xmm} [{value}, %reduce], [%acc.next, %rest.body]")
    emit("  %j.next = add i64 %j, 1")
    emit("  %rest.more = icmp ule i64 %j.next, %blocks16")
    emit("  br i1 %rest.more, label %rest.body, label %done")
    emit("rest.body:")
    copy("%j", "tail", xmm)
    fold("%acc", near, "%tail", "%acc.next", xmm, "llvm.x86.pclmulqdq")
    emit("  br label %rest")
    emit("done:")
    emit(f"  store {xmm} %acc, {pointer(xmm)} {base('out', xmm)}, align 1")
    emit("  %bytes = shl i64 %j, 4")
    emit("  ret i64 %bytes")
    emit("}")
    return "\n".join(lines)


_Fn = Callable[[int, int, int, int, int], int]


class CopyCrc:
    """A compiled copy + CRC-32 kernel (:func:`build`) and the engine that owns its code."""

    def __init__(self, fn: _Fn, engine: Any, wide: bool, accumulators: int) -> None:
        self._fn = fn
        self._engine = engine  # the machine code lives as long as the engine
        self.wide = wide
        #: Bytes below which the kernel cannot run (its first loads are K registers).
        self.min_bytes = accumulators * (32 if wide else 16)

    def __call__(self, dst: int, src: int, n: int, value: int = 0) -> int:
        """Copy ``n`` bytes from address ``src`` to address ``dst``; return
        ``zlib.crc32(those bytes, value)``.  The ranges must not overlap."""
        if n < self.min_bytes:
            ctypes.memmove(dst, src, n)
            return zlib.crc32((ctypes.c_char * n).from_address(dst), value) if n else value
        out = (ctypes.c_char * 16)()
        done = self._fn(src, dst, n, ~value & 0xFFFFFFFF, ctypes.addressof(out))
        tail = n - done
        if tail:
            ctypes.memmove(dst + done, src + done, tail)
        # the folded 16 bytes carry the CRC register so far; zlib finishes it (start
        # value 0xFFFFFFFF: a register of 0, no second inversion of the start)
        data = bytes(out) + ctypes.string_at(dst + done, tail)
        return zlib.crc32(data, 0xFFFFFFFF)


def cpu_features() -> set[str]:
    """The host CPU's features as LLVM names them (``pclmul``, ``vpclmulqdq``, ``avx2``, ...)."""
    import llvmlite.binding as llvm

    flat = llvm.get_host_cpu_features().flatten()
    return {f[1:] for f in flat.split(",") if f.startswith("+")}


def build(wide: bool | None = None) -> CopyCrc:
    """Compile the kernel for this CPU: 256-bit registers when ``wide`` (default: where the
    CPU has ``VPCLMULQDQ`` and AVX2), else 128-bit ones.  Raises ``RuntimeError`` on a CPU
    without carry-less multiply and ``ImportError`` without llvmlite."""
    import llvmlite.binding as llvm

    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"no copy + CRC-32 kernel for {platform.machine()}")
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    features = cpu_features()
    if "pclmul" not in features:
        raise RuntimeError("the CPU has no carry-less multiply (PCLMULQDQ)")
    if wide is None:
        wide = {"vpclmulqdq", "avx2"} <= features
    elif wide and not {"vpclmulqdq", "avx2"} <= features:
        raise RuntimeError("the CPU has no 256-bit carry-less multiply (VPCLMULQDQ)")
    # 4 registers of 32 bytes or 8 of 16: enough independent folds to cover the
    # multiply's latency (measured: more gained nothing)
    accumulators = 4 if wide else 8
    opaque = llvm.llvm_version_info >= (17,)
    ir = kernel_ir(accumulators, wide, opaque_pointers=opaque)
    with _numba_compiling():
        # a context of its own: LLVM's global one is not safe to share with numba's
        # compiles on other threads (pytreeio.kernels warms up on one)
        context = llvm.create_context()
        module = llvm.parse_assembly(ir, context=context)
        module.verify()
        target = llvm.Target.from_default_triple().create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3
        )
        engine = llvm.create_mcjit_compiler(module, target)
        engine.finalize_object()
        address = engine.get_function_address("copy_fold")
    c = ctypes.c_uint64
    # a ctypes call releases the GIL: threads copy in parallel
    fn = ctypes.CFUNCTYPE(ctypes.c_int64, c, c, ctypes.c_int64, c, c)(address)
    return CopyCrc(fn, (engine, module, target, context), wide, accumulators)


def _numba_compiling() -> Any:
    """numba's compiler lock when numba is imported (held while LLVM builds; never imports
    numba), else a no-op context."""
    import contextlib
    import sys

    held = sys.modules.get("numba.core.compiler_lock")
    lock = getattr(held, "global_compiler_lock", None)
    return lock if lock is not None else contextlib.nullcontext()


def enabled() -> bool:
    """Whether the kernel may be used (``PYTREEIO_NO_NUMBA=1`` turns compiled code off)."""
    return os.environ.get("PYTREEIO_NO_NUMBA", "") in ("", "0") and not _failed


def use(nbytes: int) -> CopyCrc | None:
    """The kernel, if ready, for a copy of ``nbytes``; never waits.

    The first copy of at least :data:`MIN_BYTES` starts building it on a
    background thread and goes on without it, as do all until it is ready.
    """
    if nbytes < MIN_BYTES or not enabled():
        return None
    if _kernel is None and not _warming.started:
        _warming.start()
    return _kernel


def ready(timeout: float | None = None) -> bool:
    """Build the kernel now, as the first large copy would, waiting up to ``timeout`` seconds;
    returns whether it is in use (for a process that wants the cost paid before a timed step)."""
    if not enabled():
        return False
    _warming.wait(timeout)
    return _kernel is not None


def _build_once() -> None:
    global _kernel, _failed
    with _build_lock:
        if _kernel is not None or _failed:
            return
        try:
            _kernel = build()
        except Exception:  # no llvmlite, no PCLMULQDQ, a broken LLVM: the hashing path stays
            _failed = True


_warming = Warming(_build_once, "pytreeio-copy-crc")
