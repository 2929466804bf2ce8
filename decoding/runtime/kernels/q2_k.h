/* Q2_K and Q3_K, GGUF's 2- and 3-bit K-quants, read as stored (formats_int.c includes this file twice: the scalar
 * dequantization once, the kernel once per vector width).
 *
 * GGUF (ggml-common.h), 256 weights a super-block, 16 sub-blocks of 16:
 *   Q2_K (84 bytes): scales[16] (scale sc in the low nibble, min m in the high), qs[64], fp16 d, fp16 dmin; in each
 *         128 weights, qs byte l holds weights l, 32 + l, 64 + l, 96 + l in bits 0-1, 2-3, 4-5, 6-7;
 *         w = d sc q - dmin m, q in 0..3.
 *   Q3_K (110 bytes): hmask[32] (byte l, bit b: the high bit of weight 32b + l), qs[64] as Q2_K's, 12 bytes of 6-bit
 *         scales, fp16 d;  w = d (sc - 32) (q - 4 (1 - high bit)), q the 2 low bits.
 * Packed, 8 rows: Q2_K (672 bytes): d[8], dmin[8], the scale bytes as stored [sub][row] (128), 16 chunks of qs
 *   (chunk k: each row's qs bytes 4k..4k+3); Q3_K (912): d[8], the scales minus 32 as int8 [sub][row] (128), 8 chunks
 *   of hmask, 16 chunks of qs.
 * Per output element: per super-block, for each block b of 32 weights in order (sub-blocks 2b, 2b + 1, 16 weights
 * each, their integer products against the int8 activations exact):
 *   Q2_K: i = sc_2b sum_2b(q_w q_x) + sc_2b+1 sum_2b+1(q_w q_x), n = m_2b S_2b + m_2b+1 S_2b+1 (S: the activations'
 *         sums per 16); T = fma(float(i), d_x, T), U = fma(float(n), d_x, U); then acc = fma(d, T, acc) - dmin U.
 *   Q3_K: u = q + 4 (high bit) (0..7, unsigned for the byte products), i = sc_2b (sum_2b(u q_x) - 4 S_2b) + ...;
 *         T = fma(float(i), d_x, T); then acc = fma(d, T, acc).
 */
#ifdef KQ_LANES /* ---- the kernel, once per vector width (formats_int.c's template body) ---- */

/* ---- Q2_K and Q3_K (W, a constant where inlined): MB activation rows x one group (or pair) -> acc lanes -------- */
static inline __attribute__((always_inline)) void KQ(q23k)(const int MB, const int W, const int8_t *xq,
                                                            const float *xd, const int16_t *S, int K,
                                                            const uint8_t *g0, const uint8_t *g1, kvf *acc) {
    const int nb = K / QK, three = W == W_Q3_K;
    const int rec = three ? REC_Q3_K : REC_Q2_K, sco = three ? 16 : 32, qoff = three ? 400 : 160;
    const kvi two = V8(0x03), bit2 = V8(0x04), nib = VSET32(0x0F);
    for (int i = 0; i < MB; ++i) acc[i] = VZEROF();
    for (int s = 0; s < K / QK_K; ++s) {
        const uint8_t *r0 = g0 + (long)s * rec, *r1 = G1(g1 + (long)s * rec);
        kvf T[KQ_MB], U[KQ_MB];
        for (int i = 0; i < MB; ++i) T[i] = U[i] = VZEROF();
        for (int n = 0; n < 2; ++n)
            for (int j = 0; j < 4; ++j) { /* block b: weights 128n + 32j + 0..31, sub-blocks 8n + 2j (lo), + 1 (hi) */
                const int lo = 8 * n + 2 * j, b = 8 * s + 4 * n + j;
                kvi sc_lo, sc_hi, mpair = VZERO();
                if (three) {
                    sc_lo = KQ(i8x8)(r0 + sco + 8 * lo, G1(r1 + sco + 8 * lo));
                    sc_hi = KQ(i8x8)(r0 + sco + 8 * (lo + 1), G1(r1 + sco + 8 * (lo + 1)));
                } else {
                    const kvi blo = KQ(u8x8)(r0 + sco + 8 * lo, G1(r1 + sco + 8 * lo));
                    const kvi bhi = KQ(u8x8)(r0 + sco + 8 * (lo + 1), G1(r1 + sco + 8 * (lo + 1)));
                    sc_lo = VAND(blo, nib), sc_hi = VAND(bhi, nib);
                    mpair = VOR(VSRL32(blo, 4), VSLL32(VSRL32(bhi, 4), 16)); /* (m_lo, m_hi) int16 pairs */
                }
                const kvi spair = VOR(VAND(sc_lo, VSET32(0xFFFF)), VSLL32(sc_hi, 16)); /* (sc_lo, sc_hi) pairs */
                kvi alo[KQ_MB], ahi[KQ_MB];
                for (int i = 0; i < MB; ++i) alo[i] = ahi[i] = VZERO();
#if !KQ_VNNI /* int16 sums of 4 chunks' pairs (8 products of at most 7 * 128), then times the scale into int32 */
                const kvi scp_lo = VOR(VAND(sc_lo, VSET32(0xFFFF)), VSLL32(sc_lo, 16));
                const kvi scp_hi = VOR(VAND(sc_hi, VSET32(0xFFFF)), VSLL32(sc_hi, 16));
                kvi p[KQ_MB];
                for (int i = 0; i < MB; ++i) p[i] = VZERO();
#endif
                for (int c = 0; c < 8; ++c) { /* chunk c: weights 4c + t of the block (c < 4: sub-block lo) */
                    const kvi raw = KQ(ld)(r0 + qoff + 32 * (8 * n + c), G1(r1 + qoff + 32 * (8 * n + c)));
                    kvi q = VAND(j == 0 ? raw : VSRL16(raw, 2 * j), two);
                    if (three) { /* the high bit (bit 4n + j of hmask byte 4c + t) to bit 2 (16-bit shifts within a byte) */
                        const kvi h = KQ(ld)(r0 + 144 + 32 * c, G1(r1 + 144 + 32 * c));
                        const int at = 4 * n + j;
                        q = VOR(q, VAND(at == 2 ? h : at < 2 ? VSLL16(h, 2 - at) : VSRL16(h, at - 2), bit2));
                    }
                    for (int i = 0; i < MB; ++i) {
                        const kvi x = KQ(bc4)(xq + (long)i * K + 32 * b + 4 * c);
#if KQ_VNNI
                        if (c < 4)
                            alo[i] = VDOT(alo[i], q, x);
                        else
                            ahi[i] = VDOT(ahi[i], q, x);
#else
                        p[i] = _mm256_add_epi16(p[i], _mm256_maddubs_epi16(q, x));
                        if (c == 3) alo[i] = VMADD16(p[i], scp_lo), p[i] = VZERO();
                        if (c == 7) ahi[i] = VMADD16(p[i], scp_hi);
#endif
                    }
                }
                for (int i = 0; i < MB; ++i) {
                    const int32_t sums = kq_pair(S + (long)i * (K / 16) + 2 * b); /* S_2b, S_2b+1 */
#if KQ_VNNI
                    kvi isum = VADD32(VMULLO32(alo[i], sc_lo), VMULLO32(ahi[i], sc_hi));
#else
                    kvi isum = VADD32(alo[i], ahi[i]);
#endif
                    if (three) /* the offset: u = q + 4 where the high bit is clear, so take 4 sc . S back off */
                        isum = VSUB32(isum, VSLL32(VMADD16(spair, VSET32(sums)), 2));
                    else
                        U[i] = VFMA(VCVT(VMADD16(mpair, VSET32(sums))), VSETF(xd[(long)i * nb + b]), U[i]);
                    T[i] = VFMA(VCVT(isum), VSETF(xd[(long)i * nb + b]), T[i]);
                }
            }
        const kvf d = KQ(f16)(r0, r1);
        if (three) {
            for (int i = 0; i < MB; ++i) acc[i] = VFMA(d, T[i], acc[i]);
        } else {
            const kvf dm = KQ(f16)(r0 + 16, r1 + 16);
            for (int i = 0; i < MB; ++i) acc[i] = VFNMA(dm, U[i], VFMA(d, T[i], acc[i]));
        }
    }
}

#else /* ---- the scalar dequantization of one packed row: GGUF's arithmetic in fp32 ---- */

/* Row j of a group's Q2_K (three: Q3_K) super-blocks: w = (d sc) q - (dmin m), or (d sc) q with q signed. */
static void kq_dequant_q23k(const uint8_t *group, int three, int K, int j, float *out) {
    const int rec = three ? REC_Q3_K : REC_Q2_K, qoff = three ? 400 : 160;
    for (int s = 0; s < K / QK_K; ++s) {
        const uint8_t *r = group + (long)s * rec;
        const float d = kq_h2f(((const uint16_t *)r)[j]), dmin = three ? 0.0f : kq_h2f(((const uint16_t *)(r + 16))[j]);
        for (int sub = 0; sub < 16; ++sub) {
            const int n = sub / 8, jj = (sub % 8) / 2;
            float dl, ml = 0.0f;
            if (three) {
                dl = d * (float)((const int8_t *)r)[16 + 8 * sub + j];
            } else {
                const uint8_t sc = r[32 + 8 * sub + j];
                dl = d * (float)(sc & 0x0F), ml = dmin * (float)(sc >> 4);
            }
            for (int l = 16 * (sub % 2); l < 16 * (sub % 2) + 16; ++l) { /* weight 128n + 32jj + l */
                const uint8_t byte = r[qoff + 32 * (8 * n + l / 4) + 4 * j + l % 4];
                int q = (byte >> (2 * jj)) & 3;
                if (three) q -= ((r[144 + 32 * (l / 4) + 4 * j + l % 4] >> (4 * n + jj)) & 1) ? 0 : 4;
                out[s * QK_K + 128 * n + 32 * jj + l] = three ? dl * (float)q : dl * (float)q - ml;
            }
        }
    }
}
#endif
