"""Can this CPU's AMX tiles be used, and what does one tile product cost at the shapes a decode
step's products would give it? (The next kernel step's evidence: docs/design.md, "Kernels".)

    .venv/bin/python experiments/probe_amx.py

Compiles a small C probe with the host's compiler (``-mamx-tile -mamx-int8``), asks the kernel
for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, without which the
first tile instruction faults), checks one int8 tile product against plain C, then times
``TDPBSSD`` on four independent accumulators for M rows x K bytes of A against K/4 x 16 of B
(M x 16 int32 out), and the sequence a product's group would need (load B, two products, two
stores), single-threaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } config_t;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int8_t A[16 * 64] __attribute__((aligned(64))), B[16 * 64] __attribute__((aligned(64)));
static int32_t C[16 * 16] __attribute__((aligned(64)));
static config_t c __attribute__((aligned(64)));  /* a global: a stack copy was optimized into garbage at -O2 */
static void configure(int M, int K) {
    memset(&c, 0, sizeof c); c.palette = 1;
    for (int i = 0; i < 4; i++) { c.colsb[i] = 64; c.rows[i] = M; }      /* C: M x 16 int32 */
    for (int i = 4; i < 6; i++) { c.colsb[i] = K; c.rows[i] = M; }       /* A: M x K int8 */
    for (int i = 6; i < 8; i++) { c.colsb[i] = 64; c.rows[i] = K / 4; }  /* B: K/4 x 64 int8 */
    _tile_loadconfig(&c);
}
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) {
        printf("tile state refused by the kernel\n"); return 1;
    }
    for (int i = 0; i < 1024; i++) { A[i] = (int8_t)(i % 7 - 3); B[i] = (int8_t)(i % 5 - 2); }
    configure(16, 64);
    _tile_zero(0); _tile_loadd(4, A, 64); _tile_loadd(6, B, 64); _tile_dpbssd(0, 4, 6); _tile_stored(0, C, 64);
    int wrong = 0;
    for (int m = 0; m < 16; m++) for (int n = 0; n < 16; n++) {
        int32_t ref = 0;
        for (int k = 0; k < 64; k++) ref += A[m * 64 + k] * B[(k / 4) * 64 + n * 4 + k % 4];
        wrong += ref != C[m * 16 + n];
    }
    printf("tile product vs plain C: %s\n", wrong ? "WRONG" : "identical");
    _tile_release();
    const int Ms[] = {1, 4, 8, 16}, Ks[] = {8, 32, 64};
    for (int ki = 0; ki < 3; ki++) for (int mi = 0; mi < 4; mi++) {
        const int M = Ms[mi], K = Ks[ki];
        configure(M, K);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, A, 64); _tile_loadd(5, A, 64); _tile_loadd(6, B, 64); _tile_loadd(7, B, 64);
        const long n = 1000000;
        double t = now();
        for (long i = 0; i < n; i++) { _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 5, 6); _tile_dpbssd(2, 4, 7); _tile_dpbssd(3, 5, 7); }
        const double product = (now() - t) / (4.0 * n);
        t = now();
        for (long i = 0; i < n / 4; i++) {
            _tile_loadd(6, B, 64); _tile_zero(0); _tile_zero(1);
            _tile_dpbssd(0, 4, 6); _tile_dpbusd(1, 5, 6); _tile_stored(0, C, 64); _tile_stored(1, C, 64);
        }
        const double group = (now() - t) / (n / 4);
        printf("M=%2d K=%2d: one product %5.2f ns (%6.0f GMAC/s); load B + 2 products + 2 stores %6.2f ns (%6.0f GMAC/s)\n",
               M, K, product * 1e9, M * 16.0 * K / product / 1e9, group * 1e9, 2 * M * 16.0 * K / group / 1e9);
        _tile_release();
    }
    return 0;
}
"""


def main() -> int:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if "amx_int8" not in flags:
        print("this CPU reports no amx_int8: nothing to probe")
        return 0
    compiler = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp, "probe.c"), Path(tmp, "probe")
        source.write_text(PROBE)
        subprocess.run([compiler, "-O2", "-mamx-tile", "-mamx-int8", str(source), "-o", str(binary)], check=True)
        return subprocess.run([str(binary)]).returncode


if __name__ == "__main__":
    sys.exit(main())
