"""CUDA C device helpers that the TileLang quantization kernels call (`T.call_extern`), as one prelude.

The kernels pass `PRELUDE` to `T.Kernel(..., prelude=PRELUDE)`; TileLang pastes it above the kernel.
These are the few per-element rules whose best instruction sequence TileLang cannot express:
byte permutes (`__byte_perm`), packed 16-bit max, and fused multiply-adds in a fixed order. Every
helper is exact: plain IEEE float32 arithmetic with round-to-nearest-even (no fast math, no
flush-to-zero), integer bit work, and table lookups by byte permute.

- `tl_div_rn(x, s, r)`: the float32 quotient x / s, correctly rounded, from r = RN(1 / s): q = x * r,
  then one FMA correction q += (x - q * s) * r. r is within half an ulp of 1/s, so x * r is within
  half an ulp of x / s and q = RN(x * r) is one of the two floats around x / s; then the residual is
  exact and the corrected q is RN(x / s) (Markstein's theorem; also checked on the host for 2**31
  quotients, every mantissa of x against 120 divisors). The sign of x is put back on a zero result
  (-0 / s is -0). Exact for |x / s| >= 2**-100 with s, 1/s normal (every caller's scale is in
  [2**-9, 2**126]); a smaller quotient (residual underflow) may be off by an ulp, far below any e4m3
  or e2m1 rounding boundary. x and s must be finite (Inf gives NaN): callers divide plainly there.
- `tl_e2m1_mag(y)`: the nearest e2m1 magnitude code 0..7 of |y| < 7, ties to the even code:
  m + 1.5 * 2**22 * B (B = max(1, its power of two)) rounds m to its binade's grid (0.5 below 2, 1
  below 4, 2 below 8) in one float add, and the sum's low mantissa bits plus 2 * log2(B) are the code.
- `tl_e2m1_mag_sat(y)`: the same for any y: |y| clamped to 6, NaN gives 0 (as `quant.fp4.encode_e2m1`);
  `tl_e2m1_code(y)` adds the sign bit (bit 3), `tl_e2m1x2(y0, y1)` packs two codes into a byte.
- `tl_e2m1x8_bf16(p, inv, out)`: 8 bf16 values (16 bytes) times a power of two `inv` -> 8 packed
  codes (4 bytes, element 2k in the low nibble); |x * inv| must stay below 7, which an e8m0 scale
  of the group's own finite amax ensures. Signs are gathered by byte permutes.
- `tl_absmax_bf16x8(w)`: the largest |x| bit pattern of 8 bf16 values, as float32 bits (NaN > Inf >
  finite, so one compare of the result finds a non-finite value).
- `tl_e2m1x8_e4m3(w, tlo, thi)`: 8 packed e2m1 codes -> 8 e4m3 bytes (2 words) by looking each
  magnitude up in an 8-byte table held in two registers; -0 becomes +0.
- `tl_e2m1x8_to_bf16(w, hlo, hhi, llo, lhi, out)`: 8 packed codes -> 8 bf16 values (16 bytes) from
  the high- and low-byte tables of one scale; the sign bit is copied (-0 stays -0).
  `tl_mxfp4_to_bf16(p, n, b, out)` decodes n such words with e8m0 byte b in [2, 252], where every
  value times 2**(b - 127) is a normal bf16: exponent fields come from the tables, no arithmetic.
- `tl_fp4_to_e4m3(p, n, d, out)`: n words of codes times 2**d (-5 <= d <= 6) -> e4m3 bytes, the
  exponent offset baked into the table (every nonzero value stays a normal e4m3).
"""

PRELUDE = r"""
#ifndef DSV41_DEVICE_C
#define DSV41_DEVICE_C
__device__ __forceinline__ float tl_div_rn(float x, float s, float r) {
  float q = __fmul_rn(x, r);
  q = __fmaf_rn(__fmaf_rn(-q, s, x), r, q);
  return __uint_as_float(__float_as_uint(q) | (__float_as_uint(x) & 0x80000000u));
}

__device__ __forceinline__ unsigned tl_e2m1_mag(float y) {
  unsigned b = max(__float_as_uint(y) & 0x7F800000u, 0x3F800000u);  /* binade of |y|, at least [1, 2) */
  float magic = __fmul_rn(__uint_as_float(b), 6291456.0f);
  unsigned r = __float_as_uint(__fadd_rn(fabsf(y), magic));
  return r - __float_as_uint(magic) + (b >> 22) - 254u;
}

__device__ __forceinline__ unsigned tl_e2m1_mag_sat(float y) {
  float m = fabsf(y);
  m = m <= 6.0f ? m : (m > 6.0f ? 6.0f : 0.0f);
  return tl_e2m1_mag(m);
}

__device__ __forceinline__ int tl_e2m1_code(float y) {
  return (int)(tl_e2m1_mag_sat(y) | ((__float_as_uint(y) >> 28) & 8u));
}

__device__ __forceinline__ unsigned char tl_e2m1x2(float y0, float y1) {
  return (unsigned char)(tl_e2m1_code(y0) | (tl_e2m1_code(y1) << 4));
}

__device__ __forceinline__ unsigned tl_absmax_bf16x8(const void* p) {
  const unsigned* w = (const unsigned*)p;
  unsigned m = __vmaxu2(__vmaxu2(w[0] & 0x7FFF7FFFu, w[1] & 0x7FFF7FFFu),
                        __vmaxu2(w[2] & 0x7FFF7FFFu, w[3] & 0x7FFF7FFFu));
  return max(m << 16, m & 0xFFFF0000u);
}

__device__ __forceinline__ void tl_e2m1x8_bf16(const void* p, float inv, void* out) {
  const unsigned* w = (const unsigned*)p;
  unsigned acc = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float lo = __fmul_rn(__uint_as_float(w[j] << 16), inv);
    float hi = __fmul_rn(__uint_as_float(w[j] & 0xFFFF0000u), inv);
    acc += (tl_e2m1_mag(lo) << (8 * j)) + (tl_e2m1_mag(hi) << (8 * j + 4));
  }
  unsigned a = __byte_perm(w[0], w[1], 0x7531), b = __byte_perm(w[2], w[3], 0x7531);
  unsigned even = __byte_perm(a, b, 0x6420), odd = __byte_perm(a, b, 0x7531);
  *(unsigned*)out = acc | (odd & 0x80808080u) | ((even >> 4) & 0x08080808u);
}

__device__ __forceinline__ void tl_e2m1x8_e4m3(unsigned w, unsigned tlo, unsigned thi, void* out) {
  unsigned lo = w & 0x07070707u, hi = (w >> 4) & 0x07070707u;
  unsigned wr = __byte_perm(w, 0, 0x3120);
  unsigned l = __byte_perm(tlo, thi, lo | (lo >> 12));  /* elements 0, 4, 2, 6 */
  unsigned h = __byte_perm(tlo, thi, hi | (hi >> 12));  /* elements 1, 5, 3, 7 */
  l |= (wr << 4) & (l + 0x7F7F7F7Fu) & 0x80808080u;
  h |= wr & (h + 0x7F7F7F7Fu) & 0x80808080u;
  unsigned* o = (unsigned*)out;
  o[0] = __byte_perm(l, h, 0x6240);
  o[1] = __byte_perm(l, h, 0x7351);
}

__device__ __forceinline__ void tl_e2m1x8_to_bf16(unsigned w, unsigned hlo, unsigned hhi, unsigned llo,
                                                  unsigned lhi, void* out) {
  unsigned lo = w & 0x07070707u, hi = (w >> 4) & 0x07070707u;
  unsigned sl = lo | (lo >> 12), sh = hi | (hi >> 12);
  unsigned wr = __byte_perm(w, 0, 0x3120);
  unsigned lh = __byte_perm(hlo, hhi, sl) | ((wr << 4) & 0x80808080u);  /* high bytes of 0, 4, 2, 6 */
  unsigned hh = __byte_perm(hlo, hhi, sh) | (wr & 0x80808080u);         /* high bytes of 1, 5, 3, 7 */
  unsigned ll = __byte_perm(llo, lhi, sl), hl = __byte_perm(llo, lhi, sh);
  unsigned e04 = __byte_perm(ll, lh, 0x5140), e26 = __byte_perm(ll, lh, 0x7362);
  unsigned o15 = __byte_perm(hl, hh, 0x5140), o37 = __byte_perm(hl, hh, 0x7362);
  unsigned* o = (unsigned*)out;
  o[0] = __byte_perm(e04, o15, 0x5410);
  o[1] = __byte_perm(e26, o37, 0x5410);
  o[2] = __byte_perm(e04, o15, 0x7632);
  o[3] = __byte_perm(e26, o37, 0x7632);
}
__device__ __forceinline__ void tl_mxfp4_to_bf16(const void* p, int n, unsigned b, void* out) {
  unsigned p0 = (b & 1u) << 7, pm = ((b - 1u) & 1u) << 7, pp = ((b + 1u) & 1u) << 7;
  unsigned hlo = (((b - 1u) >> 1) << 8) | ((b >> 1) * 0x01010000u);
  unsigned hhi = ((b + 1u) >> 1) * 0x0101u | (((b >> 1) + 1u) * 0x01010000u);
  unsigned llo = (pm << 8) | (p0 << 16) | ((p0 | 0x40u) << 24);
  unsigned lhi = pp | ((pp | 0x40u) << 8) | (p0 << 16) | ((p0 | 0x40u) << 24);
#pragma unroll
  for (int j = 0; j < n; ++j)
    tl_e2m1x8_to_bf16(((const unsigned*)p)[j], hlo, hhi, llo, lhi, (unsigned*)out + 4 * j);
}

__device__ __forceinline__ void tl_fp4_to_e4m3(const void* p, int n, int d, void* out) {
  unsigned off = (unsigned)(8 * (d + 5));  /* e4m3 bytes 0x30.. of 0.5.. less 40, then + 8 * (d + 5) */
  unsigned tlo = 0x14100800u + off * 0x01010100u, thi = 0x24201C18u + off * 0x01010101u;
#pragma unroll
  for (int j = 0; j < n; ++j) tl_e2m1x8_e4m3(((const unsigned*)p)[j], tlo, thi, (unsigned*)out + 2 * j);
}
#endif
"""
