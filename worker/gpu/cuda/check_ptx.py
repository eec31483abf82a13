"""Compiles the VRAM tier's CUDA kernels (kernels.cu) to PTX with NVRTC for sm_80 (A100) and sm_90
(H100/H200) and assembles each with ptxas, on a machine without a GPU or a CUDA toolkit: NVRTC and
ptxas come from NVIDIA's PyPI wheels (nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12, pinned in
requirements.txt). Checks that every kernel the host launches is there, that the arithmetic is what
the bit-identity needs — fused multiply-adds only where written (`fma.rn.f32`), no contracted or
approximate float instruction, no division, no flush-to-zero — and writes the PTX to OUT_DIR if
given (the device check carries it to a GPU).

    python worker/gpu/cuda/check_ptx.py [OUT_DIR]
"""
import ctypes
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
KERNELS = ["matvec_f32", "matvec_bf16", "matvec_f16", "matvec_fp8", "qmatvec_int8", "qmatvec_int4", "qmatvec_mxfp4", "swiglu"]
ARCHS = ["80", "90"]
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
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else None
    lib = nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    ptxas = nvidia_dir("cuda_nvcc") / "bin" / "ptxas"
    source = (HERE / "kernels.cu").read_bytes()
    for arch in ARCHS:
        ptx = compile_ptx(lib, source, arch)
        entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx))
        missing = [k for k in KERNELS if k not in entries]
        assert not missing, f"compute_{arch}: kernels missing from the PTX: {missing}"
        for pattern in FORBIDDEN:
            bad = re.findall(r"^.*" + pattern + r".*$", ptx, re.M)
            assert not bad, f"compute_{arch}: a float instruction the bit-identity forbids ({pattern}): {bad[:3]}"
        assert "fma.rn.f32" in ptx, f"compute_{arch}: no fused multiply-add in the PTX"
        path = (out or pathlib.Path("/tmp")) / f"shimmer-kernels-sm{arch}.ptx"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(ptx)
        cubin = path.with_suffix(".cubin")
        r = subprocess.run([str(ptxas), f"-arch=sm_{arch}", str(path), "-o", str(cubin)], capture_output=True, text=True)
        assert r.returncode == 0, f"ptxas -arch=sm_{arch} rejected the PTX:\n{r.stderr}"
        print(f"sm_{arch}: {len(entries)} kernels, PTX {len(ptx)} bytes, cubin {cubin.stat().st_size} bytes (NVRTC {major.value}.{minor.value})")


if __name__ == "__main__":
    main()
