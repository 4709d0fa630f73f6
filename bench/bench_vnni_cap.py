"""What the quantized GEMM's arithmetic allows on this CPU: VPDPBUSD's peak, and the cap that quant.h's
sequence puts on it (each 32-value block of a row costs 8 VPDPBUSD on 16 columns, then a conversion, a
multiply and an FMA: acc = fmaf(d_w * d_x, (float)isum, acc)). Measured with a small x86 assembly loop per
case, in registers only (no memory stalls), so the figures are this core's ceilings, to hold a GEMM's rate
from `bench.bench_gemm_quant` against (its "G MAC/s" column, per thread).

Cases: `peak` (16 independent VPDPBUSD chains); `block` (a few-row pass's block of 4 rows: 8 VPDPBUSD a row
with broadcast activation words, then the conversion, multiply and FMA); `block+loop` (also what the repacked
Q4_0 loop does beside them: the nibble masks, the high chain's shift and add, the offset broadcast from a
general register, a register copy). Needs gcc and AVX-512 VNNI.

Run by hand from the repository root (not a test):
    .venv/bin/python -m bench.bench_vnni_cap [--threads 1 2]
With --threads 2 each case runs in 2 processes at once (one per core), to show whether the clock holds.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static int words[64] __attribute__((aligned(64)));
#define V(w, a) "vpdpbusd 0(%0)%{1to16%}, %%zmm" #w ", %%zmm" #a "\n\t"
#define ROW(a, b) V(24, a) V(28, b) V(25, a) V(29, b) V(26, a) V(30, b) V(27, a) V(31, b)
#define TAIL(a, b, f) "vpsrad $4, %%zmm" #b ", %%zmm" #b "\n\t" \
    "vpaddd %%zmm" #a ", %%zmm" #b ", %%zmm" #a "\n\t" \
    "vcvtdq2ps %%zmm" #a ", %%zmm" #a "\n\t vmulps %%zmm20, %%zmm21, %%zmm22\n\t" \
    "vfmadd231ps %%zmm" #a ", %%zmm22, %%zmm" #f "\n\t"
#define INIT(a, b) "vpxord %%zmm" #a ", %%zmm" #a ", %%zmm" #a "\n\t" \
    "vpxord %%zmm" #b ", %%zmm" #b ", %%zmm" #b "\n\t"
#define INIT_LOOP(a, b) "vpbroadcastd %%esi, %%zmm" #a "\n\t vmovdqa64 %%zmm17, %%zmm" #b "\n\t"
#define NIBBLES(o, lo, hi) "vmovdqu64 " #o "(%0), %%zmm23\n\t vpandd %%zmm23, %%zmm19, %%zmm" #lo "\n\t" \
    "vpandd %%zmm23, %%zmm18, %%zmm" #hi "\n\t"
#define BLOCK ROW(0, 1) ROW(2, 3) ROW(4, 5) ROW(6, 7) \
    TAIL(0, 1, 8) TAIL(2, 3, 9) TAIL(4, 5, 10) TAIL(6, 7, 11)
#define P(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
int main(int argc, char **argv) {
    const int mode = atoi(argv[1]);
    const long iterations = 20000000;
    int *p = words;
    double start = now();
    if (mode == 0)
        for (long i = 0; i < iterations; i++)
            __asm__ volatile(P(0) P(1) P(2) P(3) P(4) P(5) P(6) P(7) P(8) P(9) P(10) P(11) P(12) P(13)
                             P(14) P(15) P(0) P(1) P(2) P(3) P(4) P(5) P(6) P(7) P(8) P(9) P(10) P(11)
                             P(12) P(13) P(14) P(15) ::: "memory");
    if (mode == 1)
        for (long i = 0; i < iterations; i++)
            __asm__ volatile(INIT(0, 1) INIT(2, 3) INIT(4, 5) INIT(6, 7) BLOCK :: "r"(p) : "memory");
    if (mode == 2)
        for (long i = 0; i < iterations; i++)
            __asm__ volatile(NIBBLES(64, 24, 28) NIBBLES(128, 25, 29) NIBBLES(192, 26, 30) NIBBLES(0, 27, 31)
                             INIT_LOOP(0, 1) INIT_LOOP(2, 3) INIT_LOOP(4, 5) INIT_LOOP(6, 7) BLOCK
                             :: "r"(p), "S"(7) : "memory");
    printf("%.4f\n", 32.0 * iterations / (now() - start) / 1e9); /* G VPDPBUSD per second */
    return 0;
}
"""
CASES = ("peak", "block", "block+loop")
MACS_PER_VPDPBUSD = 64  # 16 int32 lanes x 4 byte products


def build(workdir: Path) -> Path:
    """Compile the loops; the binary's path."""
    source, binary = workdir / "vnni_cap.c", workdir / "vnni_cap"
    source.write_text(SOURCE)
    subprocess.run(["gcc", "-O2", "-mavx512f", "-mavx512vnni", "-o", str(binary), str(source)], check=True)
    return binary


def rate(binary: Path, case: int, processes: int) -> float:
    """G VPDPBUSD/s of one process, the slowest of `processes` run at once."""
    running = [subprocess.Popen([str(binary), str(case)], stdout=subprocess.PIPE, text=True)
               for _ in range(processes)]
    rates = []
    for proc in running:
        output = proc.communicate()[0]
        if proc.returncode != 0:
            raise SystemExit(f"the loop failed (exit {proc.returncode}): this CPU needs AVX-512 VNNI")
        rates.append(float(output))
    return min(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        binary = build(Path(workdir))
        print("| processes | case | G VPDPBUSD/s per core | G MAC/s per core | of peak |")
        print("|---|---|---|---|---|")
        for processes in args.threads:
            rates = [max(rate(binary, case, processes) for _ in range(args.rounds))
                     for case in range(len(CASES))]
            for name, value in zip(CASES, rates, strict=True):
                print(f"| {processes} | {name} | {value:.3f} | {value * MACS_PER_VPDPBUSD:.1f} | "
                      f"{value / rates[0]:.0%} |")


if __name__ == "__main__":
    main()
