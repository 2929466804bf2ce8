/* Q4_K and Q5_K, GGUF's 4- and 5-bit K-quants, read as stored (formats_int.c includes this file twice: the scalar
 * dequantization once, the kernel once per vector width).
 *
 * GGUF (ggml-common.h), 256 weights a super-block:
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8] (one each per sub-block of 32),
 *         128 bytes qs; in each 64 weights, qs byte l (0..31) holds weight l (sub-block 2j) in its low nibble and
 *         weight 32 + l (sub-block 2j + 1) in its high nibble;  w = d sc q - dmin m.
 *   Q5_K (176 bytes): Q4_K's fields, then qh[32] before qs: bit 2j of qh byte l is the fifth bit of weight 64j + l,
 *         bit 2j + 1 of weight 64j + 32 + l;  w = d sc q - dmin m, q in 0..31.
 * Packed, 8 rows: Q4_K (1184 bytes): d[8], dmin[8] (fp16), sc[sub][row] (64 bytes: the 6-bit fields unpacked), m[sub][row]
 *   (64), 32 chunks of qs (chunk k: each row's qs bytes 4k..4k+3); Q5_K (1440): the same with 8 chunks of qh (chunk
 *   c: each row's qh bytes 4c..4c+3) before the qs chunks.
 * Per output element: per super-block, for each sub-block j in order: i = sc_j * sum(q_w q_x) (int32),
 *   T = fma(float(i), d_x, T), U = fma(float(m_j), s_x, U); then acc = fma(d, T, acc); acc = acc - dmin U (fused).
 */
#ifdef KQ_LANES /* ---- the kernel, once per vector width (formats_int.c's template body) ---- */

/* ---- Q4_K and Q5_K (W, a constant where inlined): MB activation rows x one group (or pair) -> acc lanes -------- */
static inline __attribute__((always_inline)) void KQ(q45k)(const int MB, const int W, const int8_t *xq,
                                                            const float *xd, const float *xs, int K,
                                                            const uint8_t *g0, const uint8_t *g1, kvf *acc) {
    const int nsb = K / QK_K, nb = K / QK;
    const int rec = W == W_Q5_K ? REC_Q5_K : REC_Q4_K, qoff = W == W_Q5_K ? 416 : 160; /* Q5_K: fifth bits at 160 */
    const kvi low = V8(0x0F), bit4 = V8(0x10);
    for (int i = 0; i < MB; ++i) acc[i] = VZEROF();
    for (int s = 0; s < nsb; ++s) {
        const uint8_t *r0 = g0 + (long)s * rec, *r1 = G1(g1 + (long)s * rec);
        kvf T[KQ_MB], U[KQ_MB];
        for (int i = 0; i < MB; ++i) T[i] = U[i] = VZEROF();
        for (int jj = 0; jj < 4; ++jj) { /* 64 weights: sub-blocks 2jj (low nibbles, Q5_K's bit 2jj) and 2jj + 1 */
            const kvi sc_lo = KQ(u8x8)(r0 + 32 + 8 * (2 * jj), r1 + 32 + 8 * (2 * jj));
            const kvi sc_hi = KQ(u8x8)(r0 + 32 + 8 * (2 * jj + 1), r1 + 32 + 8 * (2 * jj + 1));
            kvi alo[KQ_MB], ahi[KQ_MB];
            for (int i = 0; i < MB; ++i) alo[i] = ahi[i] = VZERO();
#if KQ_VNNI
            kvi blo[KQ_MB], bhi[KQ_MB]; /* few rows: odd chunks on chains of their own (dpbusd's latency) */
            for (int i = 0; i < MB; ++i) blo[i] = bhi[i] = VZERO();
#else /* int16 partial sums over 4 chunks (8 products of at most 31 * 127), then times the scale in int32 */
            const kvi scp_lo = VOR(sc_lo, VSLL32(sc_lo, 16)), scp_hi = VOR(sc_hi, VSLL32(sc_hi, 16));
            kvi plo[KQ_MB], phi[KQ_MB];
            for (int i = 0; i < MB; ++i) plo[i] = phi[i] = VZERO();
#endif
            for (int c = 0; c < 8; ++c) {
                const kvi raw = KQ(ld)(r0 + qoff + 32 * (8 * jj + c), r1 + qoff + 32 * (8 * jj + c));
                kvi lo = VAND(raw, low), hi = VAND(VSRL16(raw, 4), low);
                if (W == W_Q5_K) { /* bits 2jj and 2jj + 1 of the chunk's qh bytes to bit 4 (16-bit shifts: bit 4 of a
                                       byte comes from its own) */
                    const kvi h = KQ(ld)(r0 + 160 + 32 * c, r1 + 160 + 32 * c);
                    const kvi flo = jj == 0 ? VSLL16(h, 4) : jj == 1 ? VSLL16(h, 2) : jj == 2 ? h : VSRL16(h, 2);
                    const kvi fhi = jj == 0 ? VSLL16(h, 3) : jj == 1 ? VSLL16(h, 1) : jj == 2 ? VSRL16(h, 1)
                                                                                          : VSRL16(h, 3);
                    lo = VOR(lo, VAND(flo, bit4)), hi = VOR(hi, VAND(fhi, bit4));
                }
                for (int i = 0; i < MB; ++i) {
                    const int8_t *xb = xq + (long)i * K + s * QK_K + 64 * jj + 4 * c;
#if KQ_VNNI
                    if (KQ_SPLIT(MB) && (c & 1)) {
                        blo[i] = VDOT(blo[i], lo, KQ(bc4)(xb));
                        bhi[i] = VDOT(bhi[i], hi, KQ(bc4)(xb + 32));
                    } else {
                        alo[i] = VDOT(alo[i], lo, KQ(bc4)(xb));
                        ahi[i] = VDOT(ahi[i], hi, KQ(bc4)(xb + 32));
                    }
#else
                    plo[i] = _mm256_add_epi16(plo[i], _mm256_maddubs_epi16(lo, KQ(bc4)(xb)));
                    phi[i] = _mm256_add_epi16(phi[i], _mm256_maddubs_epi16(hi, KQ(bc4)(xb + 32)));
                    if (c == 3 || c == 7) {
                        alo[i] = VADD32(alo[i], VMADD16(plo[i], scp_lo));
                        ahi[i] = VADD32(ahi[i], VMADD16(phi[i], scp_hi));
                        plo[i] = phi[i] = VZERO();
                    }
#endif
                }
            }
#if KQ_VNNI
            if (KQ_SPLIT(MB))
                for (int i = 0; i < MB; ++i) alo[i] = VADD32(alo[i], blo[i]), ahi[i] = VADD32(ahi[i], bhi[i]);
#endif
            for (int h = 0; h < 2; ++h) {
                const int sub = 2 * jj + h, b = s * 8 + sub;
                const kvf mn = VCVT(KQ(u8x8)(r0 + 96 + 8 * sub, r1 + 96 + 8 * sub));
                for (int i = 0; i < MB; ++i) {
#if KQ_VNNI
                    const kvi isum = VMULLO32(h ? ahi[i] : alo[i], h ? sc_hi : sc_lo);
#else
                    const kvi isum = h ? ahi[i] : alo[i];
#endif
                    T[i] = VFMA(VCVT(isum), VSETF(xd[(long)i * nb + b]), T[i]);
                    U[i] = VFMA(mn, VSETF(xs[(long)i * nb + b]), U[i]);
                }
            }
        }
        const kvf d = KQ(f16)(r0, r1), dm = KQ(f16)(r0 + 16, r1 + 16);
        for (int i = 0; i < MB; ++i) acc[i] = VFNMA(dm, U[i], VFMA(d, T[i], acc[i]));
    }
}

#else /* ---- the scalar dequantization of one packed row: GGUF's arithmetic in fp32 ---- */

/* Row j of a group's Q4_K (fifth: Q5_K) super-blocks: w = (d sc) q - (dmin m). */
static void kq_dequant_q45k(const uint8_t *group, int fifth, int K, int j, float *out) {
    const int rec = fifth ? REC_Q5_K : REC_Q4_K, qoff = fifth ? 416 : 160;
    for (int s = 0; s < K / QK_K; ++s) {
        const uint8_t *r = group + (long)s * rec;
        const float d = kq_h2f(((const uint16_t *)r)[j]), dmin = kq_h2f(((const uint16_t *)(r + 16))[j]);
        for (int sub = 0; sub < 8; ++sub) {
            const float dl = d * (float)r[32 + 8 * sub + j], ml = dmin * (float)r[96 + 8 * sub + j];
            const int jj = sub / 2, high = sub % 2;
            for (int l = 0; l < 32; ++l) {
                const uint8_t byte = r[qoff + 32 * (8 * jj + l / 4) + 4 * j + l % 4];
                const int bit = fifth ? (r[160 + 32 * (l / 4) + 4 * j + l % 4] >> sub) & 1 : 0;
                out[s * QK_K + 32 * sub + l] = dl * (float)((high ? byte >> 4 : byte & 0x0F) | (bit << 4)) - ml;
            }
        }
    }
}
#endif
