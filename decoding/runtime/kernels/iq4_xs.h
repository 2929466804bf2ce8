/* IQ4_XS, GGUF's non-linear 4-bit super-blocks, read as stored (formats_int.c includes this file twice: the scalar
 * dequantization once, the kernel once per vector width).
 *
 * GGUF, 256 weights (136 bytes): fp16 d, 8 six-bit scales ls (uint16 of their top 2 bits, 4 bytes of low nibbles),
 *   per sub-block of 32 its 16 bytes of indices as IQ4_NL's;  w = d (ls - 32) v[q].
 * Packed, 8 rows (1104 bytes): d[8], the scales minus 32 as int8 (sub-block s of row j at 8s + j: 64 bytes, the one
 *   growth: 138 bytes of 136), 32 chunks of qs.
 * Per output element: per super-block, for each sub-block j: i = (ls_j - 32) sum(v[q_w] q_x) (int32, as IQ4_NL's);
 *   T = fma(float(i), d_x, T); then acc = fma(d, T, acc).
 */
#ifdef KQ_LANES /* ---- the kernel, once per vector width (formats_int.c's template body) ---- */

/* ---- IQ4_XS: 8 sub-blocks of 32 IQ4 values, each with a 6-bit scale (stored minus 32) ------------------------ */
static inline __attribute__((always_inline)) void KQ(iq4xs)(const int MB, const int8_t *xq, const float *xd,
                                                             const int16_t *S, int K, const uint8_t *g0,
                                                             const uint8_t *g1, kvf *acc) {
    const int nsb = K / QK_K, nb = K / QK;
    const kvi low = V8(0x0F), table = KQ(iq4_table)(W_IQ4_XS);
    for (int i = 0; i < MB; ++i) acc[i] = VZEROF();
    for (int s = 0; s < nsb; ++s) {
        const uint8_t *r0 = g0 + (long)s * REC_IQ4_XS, *r1 = G1(g1 + (long)s * REC_IQ4_XS);
        kvf T[KQ_MB];
        for (int i = 0; i < MB; ++i) T[i] = VZEROF();
        for (int ib = 0; ib < 8; ++ib) {
            kvi a[KQ_MB], a2[KQ_MB];
            for (int i = 0; i < MB; ++i) a[i] = a2[i] = VZERO();
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
                const kvi raw = KQ(ld)(r0 + 80 + 32 * (4 * ib + c), G1(r1 + 80 + 32 * (4 * ib + c)));
                const kvi lo = VSHUF(table, VAND(raw, low)), hi = VSHUF(table, VAND(VSRL16(raw, 4), low));
                for (int i = 0; i < MB; ++i) {
                    const int8_t *xb = xq + (long)i * K + s * QK_K + 32 * ib + 4 * c;
#if KQ_VNNI
                    if (KQ_SPLIT(MB)) /* low and high nibbles on chains of their own */
                        a[i] = VDOT(a[i], lo, KQ(bc4)(xb)), a2[i] = VDOT(a2[i], hi, KQ(bc4)(xb + 16));
                    else
                        a[i] = VDOT(VDOT(a[i], lo, KQ(bc4)(xb)), hi, KQ(bc4)(xb + 16));
#else
                    a[i] = KQ(iq4_dot)(a[i], lo, hi, xb);
#endif
                }
            }
            const kvi sc = KQ(i8x8)(r0 + 16 + 8 * ib, G1(r1 + 16 + 8 * ib));
            const int b = s * 8 + ib;
            for (int i = 0; i < MB; ++i) {
#if KQ_VNNI
                const int16_t *sp = S + (long)i * (K / 16) + 2 * b;
                const kvi dot = VSUB32(VADD32(a[i], a2[i]), VSET32(128 * ((int)sp[0] + (int)sp[1])));
#else
                const kvi dot = a[i];
#endif
                T[i] = VFMA(VCVT(VMULLO32(dot, sc)), VSETF(xd[(long)i * nb + b]), T[i]);
            }
        }
        const kvf d = KQ(f16)(r0, r1);
        for (int i = 0; i < MB; ++i) acc[i] = VFMA(d, T[i], acc[i]);
    }
}

#else /* ---- the scalar dequantization of one packed row: GGUF's arithmetic in fp32 ---- */

/* Row j of a group's IQ4_XS super-blocks: w = (d (ls - 32)) v[q]. */
static void kq_dequant_iq4xs(const uint8_t *group, int K, int j, float *out) {
    for (int s = 0; s < K / QK_K; ++s) {
        const uint8_t *r = group + (long)s * REC_IQ4_XS;
        const float d = kq_h2f(((const uint16_t *)r)[j]);
        for (int ib = 0; ib < 8; ++ib) {
            const float dl = d * (float)((const int8_t *)r)[16 + 8 * ib + j];
            for (int v = 0; v < QK; ++v) {
                const int h = v / 16, c = (v % 16) / 4, t = v % 4;
                const uint8_t byte = r[80 + 32 * (4 * ib + c) + 4 * j + t];
                out[s * QK_K + 32 * ib + v] = dl * (float)kq_iq4_values[h ? byte >> 4 : byte & 0x0F];
            }
        }
    }
}
#endif
