"""Does a product's row depend on how many rows the product has? (docs/ENGINE.md, "One sum order for
every pass": it must not, for a batch row to commit what it commits alone.)

    python scripts/product_row_invariance.py

For each kind of panel the host kernels multiply by (float32; bfloat16 on the AVX-512 tiles; bfloat16
on AMX, where the CPU has it), multiplies the same first row of x, (1, 256), by a (256, 768) weight
inside products of M = 1 .. 70 rows, and prints the largest difference of that row's 768 outputs
from the product of one row, and the groups of row counts whose row is the same bit for bit (the AVX2
tiles too, where the CPU has AVX-512, since they are what a CPU without it runs). 0 everywhere, one
group: the products are batch-invariant, as they have been since the thirty-fifth session (every tile
sums k in one chain; one AMX row is a tile). Before, the tiles split k into sets by tile height and one
AMX row took dot products: groups {1-3}, {4-7}, {8+} on the AVX-512 tiles, {1}, {2-3}, {4+} on the
AVX2 ones and {1}, {2+} on AMX (docs/results/engine/product-row-invariance-thirtyfourth.txt).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gbv.engine import host_kernels  # noqa: E402
from gbv.engine.host_kernels import PanelWeight  # noqa: E402

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 25, 33, 64, 70)


def main() -> None:
    unavailable = host_kernels.host_kernels_unavailable()
    if unavailable is not None:
        sys.exit(f"the compiled kernels do not run here: {unavailable}")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 768, generator=generator)
    x = torch.randn(max(ROWS), 256, generator=generator).numpy()
    kinds = [("float32", dict(), True), ("bfloat16, AVX-512 tiles", dict(bf16=True, amx=False), True)]
    if host_kernels.amx_products():
        kinds.append(("bfloat16, AMX (x rounded)", dict(bf16=True, amx=True), True))
    if host_kernels.avx512_tiles():  # (what a CPU without AVX-512 runs: the AVX2 tiles)
        kinds += [("float32, AVX2 tiles", dict(), False), ("bfloat16, AVX2 tiles", dict(bf16=True, amx=False), False)]
    print(f"row 0 of x (M, 256) @ W (256, 768): largest |difference| from M = 1 (outputs of size ~16)")
    print("| panels | " + " | ".join(f"M={m}" for m in ROWS) + " |")
    print("|---|" + "---:|" * len(ROWS))
    for name, options, avx512 in kinds:
        host_kernels.set_avx512_tiles(avx512)
        w = weight.to(torch.bfloat16).float() if options else weight
        panel = PanelWeight(w, **options)
        first = {}
        for m in ROWS:
            out = np.empty((m, 768), np.float32)
            panel.matmul_into(np.ascontiguousarray(x[:m]), out)
            first[m] = out[0].copy()
        groups: list[list[int]] = []  # row counts whose row 0 is the same, bit for bit
        for m in ROWS:
            for group in groups:
                if np.array_equal(first[group[0]], first[m]):
                    group.append(m)
                    break
            else:
                groups.append([m])
        cells = " | ".join(f"{float(np.abs(first[m] - first[1]).max()):.1e}" for m in ROWS)
        print(f"| {name} | {cells} |  bit-equal groups of M: {groups}")
    host_kernels.set_avx512_tiles(True)


if __name__ == "__main__":
    main()
