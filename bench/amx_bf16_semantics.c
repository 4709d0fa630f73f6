/* Which fp32 sequence do the bf16 dot-product instructions perform? A hand-run probe (not a test: it
   needs AMX-BF16 and AVX512_BF16), for the question "could a bf16 GEMM on AMX tiles keep our bit
   contract?". That contract needs every build (AMX, AVX-512, AVX2, plain x86-64) to give the same bits,
   so the instruction's arithmetic must be one we can spell out in C.

     gcc -O2 -march=native bench/amx_bf16_semantics.c -o /tmp/amx_bf16 -lm && /tmp/amx_bf16 2 && /tmp/amx_bf16 30

   One TDPBF16PS (16 x 16 outputs, 16 bf16 pairs each) and the same products through VDPBF16PS are
   compared, output by output, with four sequences written in C, on random inputs whose exponents lie
   within +-spread of 1 (the argument). Every sequence flushes denormal results to zero, as both
   instructions are documented to do. Results are in bench/RESULTS.md. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TRIALS 2000
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

enum { EVEN_ODD, ODD_EVEN, PAIR_ROUNDED, ONE_ROUNDING, SEQUENCES };
static const char *const sequence_names[SEQUENCES] = {
    "FMA per product, even then odd", "FMA per product, odd then even", "one rounding per pair",
    "one rounding per output"};

static float from_bf16(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static float flush(float x) { return fabsf(x) < 1.17549435e-38f ? copysignf(0.0f, x) : x; }

static uint64_t next_random(uint64_t *state) { /* xorshift64 */
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

static uint16_t random_bf16(uint64_t *state, int spread) {
    const int exponent = 127 + (int)(next_random(state) % (uint64_t)(2 * spread + 1)) - spread;
    return (uint16_t)(((next_random(state) & 1) << 15) | ((uint64_t)exponent << 7) | (next_random(state) & 127));
}

/* The four candidate sequences of one output: start + sum over k of a[2k] b[2k] + a[2k+1] b[2k+1]. Products
   of two bf16 are exact in fp32; sums of two of them and of the start are exact in double for spreads
   up to ~12 (beyond that ONE_ROUNDING and PAIR_ROUNDED may round twice: read them with care). */
static void candidates(float start, const uint16_t *a, const uint16_t *b, int b_stride, float out[SEQUENCES]) {
    float even_odd = start, odd_even = start, pair = start;
    double exact = start;
    for (int k = 0; k < 16; k++) {
        const float a0 = from_bf16(a[2 * k]), a1 = from_bf16(a[2 * k + 1]);
        const float b0 = from_bf16(b[k * b_stride]), b1 = from_bf16(b[k * b_stride + 1]);
        even_odd = flush(fmaf(a1, b1, flush(fmaf(a0, b0, even_odd))));
        odd_even = flush(fmaf(a0, b0, flush(fmaf(a1, b1, odd_even))));
        pair = flush((float)((double)pair + ((double)a0 * b0 + (double)a1 * b1)));
        exact += (double)a0 * b0 + (double)a1 * b1;
    }
    out[EVEN_ODD] = even_odd;
    out[ODD_EVEN] = odd_even;
    out[PAIR_ROUNDED] = pair;
    out[ONE_ROUNDING] = flush((float)exact);
}

int main(int argc, char **argv) {
    const int spread = argc > 1 ? atoi(argv[1]) : 4;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        fprintf(stderr, "this kernel does not grant AMX tile data to the process\n");
        return 2;
    }
    tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 3; t++) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    static uint16_t a[16][32], b[16][32]; /* a: 16 rows x 16 pairs; b: 16 pair rows x 16 columns' pairs */
    static float start[16][16], amx[16][16];
    long amx_differs[SEQUENCES] = {0}, avx_differs[SEQUENCES] = {0}, avx_vs_amx = 0, outputs = 0;
    uint64_t state = 88172645463325252ull;
    for (int trial = 0; trial < TRIALS; trial++) {
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 32; j++) a[i][j] = random_bf16(&state, spread), b[i][j] = random_bf16(&state, spread);
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 16; j++) start[i][j] = 3.0f * from_bf16(random_bf16(&state, spread));
        memcpy(amx, start, sizeof amx);
        _tile_loadd(0, amx, 64);
        _tile_loadd(1, a, 64);
        _tile_loadd(2, b, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, amx, 64);
        for (int m = 0; m < 16; m++) {
            __m512 acc = _mm512_loadu_ps(start[m]);
            for (int k = 0; k < 16; k++) {
                uint32_t pair;
                memcpy(&pair, &a[m][2 * k], sizeof pair);
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)pair), (__m512bh)_mm512_loadu_si512(b[k]));
            }
            float avx[16];
            _mm512_storeu_ps(avx, acc);
            for (int n = 0; n < 16; n++) {
                float expected[SEQUENCES];
                candidates(start[m][n], a[m], &b[0][2 * n], 32, expected);
                for (int s = 0; s < SEQUENCES; s++) {
                    amx_differs[s] += memcmp(&expected[s], &amx[m][n], sizeof(float)) != 0;
                    avx_differs[s] += memcmp(&expected[s], &avx[n], sizeof(float)) != 0;
                }
                avx_vs_amx += memcmp(&avx[n], &amx[m][n], sizeof(float)) != 0;
                outputs++;
            }
        }
    }
    _tile_release();
    printf("spread %d, %ld outputs; outputs that differ from each sequence:\n", spread, outputs);
    for (int s = 0; s < SEQUENCES; s++)
        printf("  %-32s TDPBF16PS %7ld   VDPBF16PS %7ld\n", sequence_names[s], amx_differs[s], avx_differs[s]);
    printf("  TDPBF16PS vs VDPBF16PS: %ld\n", avx_vs_amx);
    return 0;
}
