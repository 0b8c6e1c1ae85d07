"""Write a copy of a FlashInfer wheel without the CUDA sources of kernels fxfuse never builds.

The device tool carries at most 64 MiB per call: FlashInfer 0.7.2.post1 (62 MB) and apache-tvm-ffi
(3.3 MB) leave too little for the tree. The sources under flashinfer/experimental/, moe_ep/ and
fused_moe/ (.cu, .cuh, .c, .h; about 3 MB compressed) belong to kernels JIT-built only when those
features are used; their Python modules stay, and the wheel's RECORD drops the removed files, so pip
installs the copy as it does the original. Seen working on the H200 on 2026-12-02: the TensorRT-LLM,
PCIe and norm kernels built and every GPU test passed.

When to run it: once per FlashInfer wheel that GPU runs carry (e.g. the `.whl072s` folder DEVELOPERS.md
names), before the device calls; scripts/gpu_check.sh installs whatever the carried folder holds.
Usage: python scripts/trim_flashinfer_wheel.py SRC_WHEEL DEST_DIR
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

#: Files left out: CUDA/C sources of the kernel families fxfuse does not use.
UNUSED_SOURCES = re.compile(r"^flashinfer/(experimental|moe_ep|fused_moe)/.*\.(cu|cuh|c|h)$")


def trim(source: Path, dest_dir: Path) -> Path:
    """Copy `source` into `dest_dir` (same file name) without the files `UNUSED_SOURCES` matches."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / source.name
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if UNUSED_SOURCES.match(info.filename):
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not UNUSED_SOURCES.match(line.split(",")[0])]
                data = ("\n".join(kept) + "\n").encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.rsplit("Usage: ", 1)[1].strip())
    out = trim(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
