"""Compiles the VRAM tier's CUDA kernels (kernels.cu) to PTX with NVRTC and assembles it with ptxas
for sm_70 (V100), sm_80 (A100) and sm_90 (H100/H200), on a machine without a GPU or a CUDA toolkit:
NVRTC and ptxas come from NVIDIA's PyPI wheels (nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12,
pinned in requirements.txt). Checks that every kernel the host launches is there, that no float
instruction could round differently from the CPU — no contractible or approximate one, no
division, no flush-to-zero — and that the committed `kernels.ptx` (compute_70, which the driver
compiles for any newer GPU; the binary embeds it, so running needs no NVRTC) is what this source
compiles to.

    python worker/gpu/cuda/check_ptx.py [--write] [OUT_DIR]    (--write: update kernels.ptx)
"""
import ctypes
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
KERNELS = ["matvec_f32", "matvec_bf16", "matvec_f16", "matvec_fp8", "qmatvec_int8", "qmatvec_int4", "qmatvec_mxfp4", "swiglu"]
# The PTX's virtual architecture, and the GPUs it is assembled for.
PTX_ARCH = "70"
SM = ["70", "80", "90"]
# What a PTX float instruction may be: round-to-nearest, explicit. `mad`, float arithmetic without
# .rn, any .approx or .ftz, and division are not allowed.
# An add, sub or mul without a rounding mode may be contracted into an fma by ptxas.
FORBIDDEN = [
    r"\bmad\.f32",
    r"\b(fma|add|sub|mul)\.f32",
    r"\.ftz\b",
    r"\.approx\b",
    r"\bdiv\.(rn\.)?f32",
    r"\brcp\.",
    r"\bsqrt\.",
]


def nvidia_dir(name: str) -> pathlib.Path:
    import nvidia  # the wheels' namespace package

    for root in nvidia.__path__:
        p = pathlib.Path(root) / name
        if p.is_dir():
            return p
    raise SystemExit(f"error: the {name} wheel is not installed (pip install -r worker/gpu/cuda/requirements.txt)")


def nvrtc():
    lib = next((nvidia_dir("cuda_nvrtc") / "lib").glob("libnvrtc.so.*"))
    return ctypes.CDLL(str(lib))


def compile_ptx(lib, source: bytes, arch: str) -> str:
    prog = ctypes.c_void_p()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"kernels.cu", 0, None, None), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture=compute_{arch}".encode(), b"--fmad=false", b"--ftz=false", b"--prec-div=true", b"--prec-sqrt=true", b"-std=c++14"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise SystemExit(f"error: NVRTC could not compile kernels.cu for compute_{arch}:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    check(lib, lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


def check(lib, rc: int, what: str):
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise SystemExit(f"error: {what}: {lib.nvrtcGetErrorString(rc).decode()}")


def main():
    args = [a for a in sys.argv[1:] if a != "--write"]
    out = pathlib.Path(args[0]) if args else pathlib.Path("/tmp")
    lib = nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    ptxas = nvidia_dir("cuda_nvcc") / "bin" / "ptxas"
    ptx = compile_ptx(lib, (HERE / "kernels.cu").read_bytes(), PTX_ARCH)
    entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx))
    missing = [k for k in KERNELS if k not in entries]
    assert not missing, f"kernels missing from the PTX: {missing}"
    for pattern in FORBIDDEN:
        bad = re.findall(r"^.*" + pattern + r".*$", ptx, re.M)
        assert not bad, f"a float instruction the bit-identity forbids ({pattern}): {bad[:3]}"
    assert "fma.rn.f32" in ptx, "no fused multiply-add in the PTX"
    committed = HERE / "kernels.ptx"
    if "--write" in sys.argv:
        committed.write_text(ptx)
    elif committed.read_text() != ptx:
        raise SystemExit("error: worker/gpu/cuda/kernels.ptx is not what kernels.cu compiles to: run python worker/gpu/cuda/check_ptx.py --write")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "shimmer-kernels.ptx"
    path.write_text(ptx)
    for sm in SM:
        cubin = out / f"shimmer-kernels-sm{sm}.cubin"
        r = subprocess.run([str(ptxas), f"-arch=sm_{sm}", str(path), "-o", str(cubin)], capture_output=True, text=True)
        assert r.returncode == 0, f"ptxas -arch=sm_{sm} rejected the PTX:\n{r.stderr}"
        print(f"sm_{sm}: {len(entries)} kernels, cubin {cubin.stat().st_size} bytes (PTX {len(ptx)} bytes for compute_{PTX_ARCH}, NVRTC {major.value}.{minor.value})")


if __name__ == "__main__":
    main()
