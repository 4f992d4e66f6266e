"""Build of mha_ext: CPU kernels always, CUDA kernels when torch and a toolkit allow.

Environment:
  MHA_EXT_CUDA          unset: build CUDA when torch is a CUDA build and a toolkit is found;
                        0: CPU only; 1: CUDA required (fails loudly when it cannot be built).
  CUDA_HOME             CUDA toolkit; else /usr/local/cuda when it holds nvcc and libcudart.
  TORCH_CUDA_ARCH_LIST  GPU architectures; with no GPU visible it defaults to "8.0;9.0".
  MHA_EXT_HEAD_DIMS     head dims with tensor-core attention kernels (default "64,128").
  MHA_EXT_SANITIZE      sanitizers for a checking build, a comma list of address, undefined
                        (e.g. "address,undefined"): CPU only, -O1 -g, and the first error
                        aborts; a few costly checks are left out (extension() names them).
                        Python is not instrumented: run it with the ASan runtime
                        LD_PRELOADed (.ci/run's sanitizer step shows how).
  MAX_JOBS              parallel compile jobs (ninja).
"""

import os
import platform
import re
import sys
from pathlib import Path

import torch
from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()
DEFAULT_CUDA_ARCHS = "8.0;9.0"


def package_version():
    """mha_ext.__version__, read from the package's source: the number is written once, and
    importing the package here would need the extension this build is about to make."""
    init = (ROOT / "mha_ext" / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', init, re.MULTILINE)
    if match is None:
        sys.exit('setup.py: mha_ext/__init__.py must set __version__ = "X.Y.Z" on one line')
    return match.group(1)


def find_cuda_home():
    """CUDA_HOME if set, else /usr/local/cuda when it is a complete toolkit.

    torch guesses the toolkit from the nvcc on PATH; where that nvcc is a wrapper script in
    another folder the guess is wrong and linking fails (cannot find -lcudart).
    """
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    default = Path("/usr/local/cuda")
    if (default / "bin" / "nvcc").is_file() and (default / "lib64" / "libcudart.so").is_file():
        return str(default)
    return None


KNOWN_SANITIZERS = ("address", "undefined")


def sanitizers():
    """The sanitizers MHA_EXT_SANITIZE asks for, in a fixed order; empty when unset."""
    setting = os.environ.get("MHA_EXT_SANITIZE", "")
    chosen = {name.strip() for name in setting.split(",") if name.strip()}
    unknown = chosen - set(KNOWN_SANITIZERS)
    if unknown:
        sys.exit(
            f"setup.py: MHA_EXT_SANITIZE takes a comma list of {', '.join(KNOWN_SANITIZERS)}, "
            f"got {setting!r}"
        )
    return [name for name in KNOWN_SANITIZERS if name in chosen]


SANITIZERS = sanitizers()


def want_cuda():
    mode = os.environ.get("MHA_EXT_CUDA", "")
    if mode not in ("", "0", "1"):
        sys.exit(f"setup.py: MHA_EXT_CUDA must be 0, 1 or unset, got {mode!r}")
    if mode == "0":
        return False
    if SANITIZERS:
        if mode == "1":
            sys.exit("setup.py: MHA_EXT_SANITIZE builds the CPU kernels only; unset MHA_EXT_CUDA")
        print("setup.py: building CPU only: MHA_EXT_SANITIZE is set")
        return False
    cuda_home = find_cuda_home()
    problem = None
    if torch.version.cuda is None:
        problem = f"torch {torch.__version__} is not a CUDA build"
    elif cuda_home is None:
        problem = "no CUDA toolkit found (set CUDA_HOME)"
    if problem is None:
        os.environ["CUDA_HOME"] = cuda_home
        return True
    if mode == "1":
        sys.exit(f"setup.py: MHA_EXT_CUDA=1 but {problem}")
    print(f"setup.py: building CPU only: {problem}")
    return False


WITH_CUDA = want_cuda()
if WITH_CUDA and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
    # torch's own arch detection needs a visible GPU and crashes without one.
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS

# Imported after CUDA_HOME is settled: cpp_extension reads it at import time.
from torch.utils import cpp_extension  # noqa: E402


def sources(*groups):
    """The paths of csrc/sources.txt's groups, in the file's order (which is the build order
    the file explains)."""
    found = []
    for line in (ROOT / "csrc" / "sources.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            group, path = line.split()
            if group in groups:
                found.append(path)
    return found


def cpu_sources():
    groups = ["python", "cpu", "kernels"]
    if platform.machine() in ("x86_64", "AMD64"):
        groups.append("kernels_x86")
    return sources(*groups)


def cuda_sources():
    return sources("cuda", "cuda_kernels")


def tensor_core_head_dims():
    """Head dims that get a tensor-core attention kernel: 64 and 128 unless MHA_EXT_HEAD_DIMS
    (comma-separated multiples of 16 up to 256) says otherwise. Each one adds compile time."""
    setting = os.environ.get("MHA_EXT_HEAD_DIMS", "64,128")
    try:
        dims = sorted({int(dim) for dim in setting.split(",") if dim.strip()})
    except ValueError:
        dims = []
    if not dims or any(dim % 16 or not 16 <= dim <= 256 for dim in dims):
        sys.exit(
            f"setup.py: MHA_EXT_HEAD_DIMS must list multiples of 16 in [16, 256], got {setting!r}"
        )
    return dims


def extension():
    torch_version = torch.__version__.split("+")[0]
    cxx_flags = ["-O3", "-fopenmp", f"-DMHA_EXT_TORCH_VERSION={torch_version}"]
    include_dirs = [str(ROOT / "csrc" / "include"), str(ROOT / "csrc")]
    link_flags = ["-fopenmp"]
    if SANITIZERS:
        # -O1 keeps the reports' stacks close to the source (and builds faster than -O3);
        # every error aborts, so a test run cannot pass with a report in its log.
        sanitize = [f"-fsanitize={','.join(SANITIZERS)}", "-fno-sanitize-recover=all"]
        # Left out, as they cost most of the build for little: with them gcc spent 300 s (ASan)
        # and 160 s (UBSan) on one kernel build that takes 65 s and 45 s without (2 Xeon
        # cores). ASan's use-after-scope (stack variables used after their block; overflows of
        # live stack buffers are still caught); UBSan's null (a null access faults anyway),
        # alignment (x86 loads misaligned data; the kernels' aligned vector loads fault),
        # pointer-overflow, and object-size and vptr (ASan covers the first, the kernels have
        # no virtual calls of their own).
        if "address" in SANITIZERS:
            sanitize.append("-fno-sanitize-address-use-after-scope")
        if "undefined" in SANITIZERS:
            sanitize.append("-fno-sanitize=null,alignment,pointer-overflow,object-size,vptr")
        cxx_flags = [flag if flag != "-O3" else "-O1" for flag in cxx_flags]
        cxx_flags += sanitize + ["-fno-omit-frame-pointer", "-g"]
        link_flags += sanitize
    if not WITH_CUDA:
        return cpp_extension.CppExtension(
            "mha_ext._C",
            cpu_sources(),
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").strip(";").replace(";", ",")
    cxx_flags += ["-DMHA_EXT_WITH_CUDA", f"-DMHA_EXT_CUDA_ARCHS={archs}"]
    # Bit i compiles head dim 16 * (i + 1) (see csrc/cuda/kernels/attention_mma.cu).
    head_dim_mask = sum(1 << (dim // 16 - 1) for dim in tensor_core_head_dims())
    head_dims = f"-DMHA_EXT_HEAD_DIM_MASK={head_dim_mask}"
    return cpp_extension.CUDAExtension(
        "mha_ext._C",
        cpu_sources() + cuda_sources(),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++20", head_dims]},
        extra_link_args=["-fopenmp"],
    )


setup(
    name="mha_ext",
    version=package_version(),
    description="Fused multi-head attention for PyTorch: FlashAttention-style CPU and CUDA kernels",
    packages=find_packages(include=["mha_ext", "mha_ext.*"]),
    package_data={"mha_ext": ["data/*.txt"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.9",
    # numpy: torch imports without it but warns "Failed to initialize NumPy" on every import.
    install_requires=["torch>=2.5", "numpy"],
    # mha_ext.integrations.transformers registers an attention implementation with it.
    extras_require={
        "transformers": ["transformers>=5.0"],
        "test": ["pytest", "hypothesis>=6.170", "numpy"],
    },
)
