/* AVX2 kernels of the quantized-weight GEMM (placeholder until written: the portable path runs). */
#include "quant.h"
