/* Q6_K, GGUF's 6-bit K-quant, read as stored (formats_int.c includes this file twice: the scalar dequantization
 * once, the kernel once per vector width).
 *
 * GGUF, 256 weights (210 bytes): ql[128], qh[64], int8 scales[16] (one per 16), fp16 d; in each half of 128, ql byte
 *   l (0..63) holds the low 4 bits of weights l (low nibble) and 64 + l (high nibble), qh byte l (0..31) the high 2
 *   bits of weights l, 32 + l, 64 + l, 96 + l (bits 0-1, 2-3, 4-5, 6-7);  w = d sc (q - 32), q in 0..63.
 * Packed, 8 rows (1680 bytes): d[8] (fp16), then per block of 32 weights b, in the order the kernel reads them (208
 *   bytes): the rows' scale pairs (sc[2b], sc[2b+1]) (16 bytes), 4 chunks of low bits (chunk p, byte 4j + t: the low
 *   4 bits of row j's weights 32b + 4p + t (low nibble) and 32b + 16 + 4p + t (high nibble)), 2 chunks of high bits
 *   (chunk k, byte 4j + t, bits 2u, 2u + 1: the high 2 bits of row j's weight 32b + 16k + 4u + t): the file's bit
 *   fields regrouped by block, so every byte is read once and in order.
 * Per output element: per super-block, for each block of 32 b in order:
 *   i = sc_2b (sum(q_w q_x) - 32 S_2b) + sc_2b+1 (the same over the second 16) (int32); T = fma(float(i), d_x, T);
 *   then acc = fma(d, T, acc).
 */
#ifdef KQ_LANES /* ---- the kernel, once per vector width (formats_int.c's template body) ---- */

/* ---- Q6_K ------------------------------------------------------------------------------------------------------ */
/* Block b (0..7) of the super-block at r0 (r1): weights 32b + 4c + t (sub-block 2b: c < 4; 2b + 1: c >= 4) of each
   activation row from x (the super-block's first); T[i] = fma(float(i), d_x, T[i]). */
static inline __attribute__((always_inline)) void KQ(q6k_block)(const int MB, const int8_t *xq, const float *xd,
                                                                 const int16_t *S, int K, int bb, const uint8_t *r0,
                                                                 const uint8_t *r1, kvf *T) {
    const int nb = K / QK;
    const kvi low = V8(0x0F), top = V8(0x30);
    const kvi P = KQ(i8x16)(r0, G1(r1)); /* (sc_2b, sc_2b+1) int16 pairs */
    const kvi H0 = KQ(ld)(r0 + 144, G1(r1 + 144)), H1 = KQ(ld)(r0 + 176, G1(r1 + 176));
#if KQ_VNNI
    const kvi sa = VSRA32(VSLL32(P, 16), 16), sb = VSRA32(P, 16);
    kvi aa[KQ_MB], ab[KQ_MB], ca[KQ_MB], cb[KQ_MB]; /* ca, cb: the odd chunks' chains, for few rows */
    for (int i = 0; i < MB; ++i) aa[i] = ab[i] = ca[i] = cb[i] = VZERO();
#else
    const kvi sca = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(P, 0xA0), 0xA0); /* (sc_2b, sc_2b) */
    const kvi scb = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(P, 0xF5), 0xF5); /* (sc_2b+1, sc_2b+1) */
    kvi a32[KQ_MB], pa[KQ_MB], pb[KQ_MB];
    for (int i = 0; i < MB; ++i) a32[i] = pa[i] = pb[i] = VZERO();
#endif
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) { /* weights 4p + t (low nibbles, high bits in H0) and 16 + 4p + t (high, H1) */
        const kvi L = KQ(ld)(r0 + 16 + 32 * p, G1(r1 + 16 + 32 * p));
        const kvi h0 = p == 0 ? VSLL16(H0, 4) : p == 1 ? VSLL16(H0, 2) : p == 2 ? H0 : VSRL16(H0, 2);
        const kvi h1 = p == 0 ? VSLL16(H1, 4) : p == 1 ? VSLL16(H1, 2) : p == 2 ? H1 : VSRL16(H1, 2);
        const kvi qa = VOR(VAND(L, low), VAND(h0, top)), qb = VOR(VAND(VSRL16(L, 4), low), VAND(h1, top));
        for (int i = 0; i < MB; ++i) {
            const int8_t *x = xq + (long)i * K + 32 * bb + 4 * p;
#if KQ_VNNI
            if (KQ_SPLIT(MB) && (p & 1)) {
                ca[i] = VDOT(ca[i], qa, KQ(bc4)(x));
                cb[i] = VDOT(cb[i], qb, KQ(bc4)(x + 16));
            } else {
                aa[i] = VDOT(aa[i], qa, KQ(bc4)(x));
                ab[i] = VDOT(ab[i], qb, KQ(bc4)(x + 16));
            }
#else /* two chunks' pairs in int16 (at most 4 * 63 * 127), then times the scale into int32 */
            const kvi ua = _mm256_maddubs_epi16(qa, KQ(bc4)(x)), ub = _mm256_maddubs_epi16(qb, KQ(bc4)(x + 16));
            if (p & 1) {
                a32[i] = VADD32(a32[i], VMADD16(_mm256_add_epi16(pa[i], ua), sca));
                a32[i] = VADD32(a32[i], VMADD16(_mm256_add_epi16(pb[i], ub), scb));
            } else {
                pa[i] = ua, pb[i] = ub;
            }
#endif
        }
    }
    for (int i = 0; i < MB; ++i) {
        const kvi corr = VMADD16(P, VSET32(kq_pair(S + (long)i * (K / 16) + 2 * bb))); /* sc . S per lane */
#if KQ_VNNI
        const kvi dot = VADD32(VMULLO32(VADD32(aa[i], ca[i]), sa), VMULLO32(VADD32(ab[i], cb[i]), sb));
#else
        const kvi dot = a32[i];
#endif
        T[i] = VFMA(VCVT(VSUB32(dot, VSLL32(corr, 5))), VSETF(xd[(long)i * nb + bb]), T[i]);
    }
}

static inline __attribute__((always_inline)) void KQ(q6k)(const int MB, const int8_t *xq, const float *xd,
                                                           const int16_t *S, int K, const uint8_t *g0,
                                                           const uint8_t *g1, kvf *acc) {
    for (int i = 0; i < MB; ++i) acc[i] = VZEROF();
    for (int s = 0; s < K / QK_K; ++s) {
        const uint8_t *r0 = g0 + (long)s * REC_Q6_K, *r1 = G1(g1 + (long)s * REC_Q6_K);
        kvf T[KQ_MB];
        for (int i = 0; i < MB; ++i) T[i] = VZEROF();
        for (int b = 0; b < 8; ++b)
            KQ(q6k_block)(MB, xq, xd, S, K, 8 * s + b, r0 + 16 + 208 * b, G1(r1 + 16 + 208 * b), T);
        const kvf d = KQ(f16)(r0, r1);
        for (int i = 0; i < MB; ++i) acc[i] = VFMA(d, T[i], acc[i]);
    }
}

#else /* ---- the scalar dequantization of one packed row: GGUF's arithmetic in fp32 ---- */

/* Row j of a group's Q6_K super-blocks: w = (d sc) (q - 32). */
static void kq_dequant_q6k(const uint8_t *group, int K, int j, float *out) {
    for (int s = 0; s < K / QK_K; ++s) {
        const uint8_t *r = group + (long)s * REC_Q6_K;
        const float d = kq_h2f(((const uint16_t *)r)[j]);
        float *o = out + s * QK_K;
        for (int v = 0; v < QK_K; ++v) {
            const int b = v / 32, k = (v % 32) / 16, p = (v % 16) / 4, t = v % 4;
            const uint8_t *rb = r + 16 + 208 * b;
            const uint8_t qlb = rb[16 + 32 * p + 4 * j + t], qhb = rb[144 + 32 * k + 4 * j + t];
            const int q = ((k ? qlb >> 4 : qlb & 0x0F) | (((qhb >> (2 * p)) & 3) << 4)) - 32;
            const float dl = d * (float)((const int8_t *)rb)[2 * j + k];
            o[v] = dl * (float)q;
        }
    }
}
#endif
