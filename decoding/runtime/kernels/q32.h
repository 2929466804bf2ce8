/* The 32-weight blocks beyond Q8_0 / Q4_1: Q5_0, Q4_0, Q5_1 and the non-linear IQ4_NL and MXFP4, read as stored
 * (formats_int.c includes this file twice: the scalar dequantization once, the kernel once per vector width).
 *
 * GGUF, 32 weights a block: Q5_0 (22 bytes): fp16 d, 32 bits qh (bit t: weight t's fifth bit), 16 bytes qs (weight t
 *   low nibble, 16 + t high nibble), w = d (q - 16); Q4_0 (18): fp16 d, qs, w = d (q - 8); Q5_1 (24): fp16 d, fp16 m,
 *   qh, qs, w = d q + m; IQ4_NL (18): as Q4_0, q indexing 16 values v[q] from -127 to 113, w = d v[q]; MXFP4 (17):
 *   an E8M0 byte e, qs as Q4_0's indexing the 16 doubled E2M1 values v[q] from -12 to 12, w = 2^(e - 128) v[q].
 * Packed, 8 rows: Q5_0 (176 bytes): d[8] (fp16), a chunk of fifth bits (byte 4j + t, bit 2c + h: row j's weight
 *   16h + 4c + t), 4 chunks of qs (chunk c: each row's qs bytes 4c..4c+3); Q4_0, IQ4_NL (144): d[8], 4 chunks of qs;
 *   MXFP4 (136): e[8], 4 chunks of qs;
 *   Q5_1 (192): d[8], m[8], the fifth bits and qs chunks as Q5_0's.
 * Per output element, per block in order: Q5_0, Q4_0: i = sum(q_w q_x) - 16 (Q4_0: 8) (S_2b + S_2b+1),
 *   acc = fma(float(i), d d_x, acc); Q5_1: i = sum(q_w q_x), then also acc = fma(m, s_x, acc); IQ4_NL: as Q5_0 with
 *   i = sum(v[q_w] q_x) (on dpbusd: the table plus 128, then 128 (S_2b + S_2b+1) taken off; on AVX2 maddubs of |v|
 *   and x with v's sign); MXFP4 as IQ4_NL with its table and d = 2^(e - 128).
 */
#ifdef KQ_LANES /* ---- the kernel, once per vector width (formats_int.c's template body) ---- */

/* ---- the 32-weight blocks: Q5_0, Q4_0, Q5_1, IQ4_NL (W, a constant where inlined) ------------------------------- */
/* The 16 IQ4 values as the byte table the shuffles read (one copy per 128-bit lane): plus 128 where the products run
   on dpbusd (unsigned x signed), as int8 where they run on maddubs with the signs moved onto the activations. */
static inline kvi KQ(iq4_table)(const int W) {
#if KQ_VNNI
    const __m128i t = _mm_loadu_si128((const __m128i *)(W == W_MXFP4 ? kq_mxfp4_plus128 : kq_iq4_plus128));
#else
    const __m128i t = _mm_loadu_si128((const __m128i *)(W == W_MXFP4 ? kq_mxfp4_values : kq_iq4_values));
#endif
#if KQ_LANES == 16
    return _mm512_broadcast_i32x4(t);
#else
    return _mm256_broadcastsi128_si256(t);
#endif
}

#if !KQ_VNNI
/* acc + the products of a chunk's signed IQ4 values (lo: weights 4c + t, hi: 16 + 4c + t) and the activations at x
   (x, x + 16), in int32 lanes: |v| times x with v's sign on maddubs, pairs <= 2 * 127 * 127. */
static inline kvi KQ(iq4_dot)(kvi acc, kvi lo, kvi hi, const int8_t *x) {
    const kvi ones = _mm256_set1_epi16(1);
    const kvi pl = _mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(KQ(bc4)(x), lo));
    const kvi ph = _mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(KQ(bc4)(x + 16), hi));
    return VADD32(acc, VADD32(VMADD16(pl, ones), VMADD16(ph, ones)));
}
#endif

/* MXFP4's E8M0 scale bytes of a group (or pair) as floats, one per lane: kq_e8m0_half's bits, (e - 1) << 23, or
   0x00200000 << e for e < 2 (the two subnormals), made in the vector lanes (one block's 8 or 16 scales from scalar
   conversions through memory took a decode step's share of the time). */
static inline kvf KQ(e8m0)(const uint8_t *a, const uint8_t *b) {
    const kvi e = KQ(u8x8)(a, b);
#if KQ_LANES == 16
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 sub = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(sub, normal, small));
#else
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
#endif
}

static inline __attribute__((always_inline)) void KQ(q32)(const int MB, const int W, const int8_t *xq,
                                                           const float *xd, const float *xs, const int16_t *S, int K,
                                                           const uint8_t *g0, const uint8_t *g1, kvf *acc) {
    const int nb = K / QK;
    const int rec = W == W_Q5_0 ? REC_Q5_0 : W == W_Q5_1 ? REC_Q5_1 : W == W_IQ4_NL ? REC_IQ4_NL
                  : W == W_MXFP4 ? REC_MXFP4 : REC_Q4_0;
    const int qoff = W == W_Q5_0 ? 48 : W == W_Q5_1 ? 64 : W == W_MXFP4 ? 8 : 16, foff = W == W_Q5_0 ? 16 : 32;
    const int fifth_bits = W == W_Q5_0 || W == W_Q5_1, tabled = W == W_IQ4_NL || W == W_MXFP4;
    const kvi low = V8(0x0F), bit4 = V8(0x10);
    const kvi table = tabled ? KQ(iq4_table)(W) : VZERO();
#if !KQ_VNNI
    const kvi ones = _mm256_set1_epi16(1);
#endif
    for (int i = 0; i < MB; ++i) acc[i] = VZEROF();
    for (int b = 0; b < nb; ++b) {
        const uint8_t *r0 = g0 + (long)b * rec, *r1 = G1(g1 + (long)b * rec);
        kvi a[KQ_MB], plo[KQ_MB], phi[KQ_MB];
        for (int i = 0; i < MB; ++i) a[i] = plo[i] = phi[i] = VZERO();
        const kvi fifth = fifth_bits ? KQ(ld)(r0 + foff, G1(r1 + foff)) : VZERO(); /* bit 2c + h of byte 4j + t */
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const kvi raw = KQ(ld)(r0 + qoff + 32 * c, G1(r1 + qoff + 32 * c));
            kvi lo = VAND(raw, low), hi = VAND(VSRL16(raw, 4), low);
            if (fifth_bits) { /* bit 2c (low nibbles) and 2c + 1 (high) to bit 4 (16-bit shifts: bit 4 of a byte
                                 comes from its own) */
                const kvi flo = c == 0 ? VSLL16(fifth, 4) : c == 1 ? VSLL16(fifth, 2) : c == 2 ? fifth
                                                                                               : VSRL16(fifth, 2);
                const kvi fhi = c == 0 ? VSLL16(fifth, 3) : c == 1 ? VSLL16(fifth, 1) : c == 2 ? VSRL16(fifth, 1)
                                                                                               : VSRL16(fifth, 3);
                lo = VOR(lo, VAND(flo, bit4)), hi = VOR(hi, VAND(fhi, bit4));
            }
            if (tabled) lo = VSHUF(table, lo), hi = VSHUF(table, hi);
            for (int i = 0; i < MB; ++i) {
                const int8_t *xb = xq + (long)i * K + b * QK + 4 * c;
#if KQ_VNNI
                if (KQ_SPLIT(MB)) /* low and high nibbles on chains of their own */
                    a[i] = VDOT(a[i], lo, KQ(bc4)(xb)), plo[i] = VDOT(plo[i], hi, KQ(bc4)(xb + 16));
                else
                    a[i] = VDOT(VDOT(a[i], lo, KQ(bc4)(xb)), hi, KQ(bc4)(xb + 16));
#else
                if (tabled) {
                    a[i] = KQ(iq4_dot)(a[i], lo, hi, xb);
                } else { /* int16 lanes: 8 products of at most 31 * 127 each */
                    plo[i] = _mm256_add_epi16(plo[i], _mm256_maddubs_epi16(lo, KQ(bc4)(xb)));
                    phi[i] = _mm256_add_epi16(phi[i], _mm256_maddubs_epi16(hi, KQ(bc4)(xb + 16)));
                }
#endif
            }
        }
        const kvf d = W == W_MXFP4 ? KQ(e8m0)(r0, r1) : KQ(f16)(r0, r1);
        const kvf mn = W == W_Q5_1 ? KQ(f16)(r0 + 16, r1 + 16) : VZEROF();
        for (int i = 0; i < MB; ++i) {
#if KQ_VNNI
            if (KQ_SPLIT(MB)) a[i] = VADD32(a[i], plo[i]);
#else
            if (!tabled) a[i] = VADD32(VMADD16(plo[i], ones), VMADD16(phi[i], ones));
#endif
            const int16_t *sp = S ? S + (long)i * (K / 16) + 2 * b : 0;
            /* the weights' offset times the activations' sum: Q5_0 16, Q4_0 8; the tables' 128 on dpbusd */
            const int offset = W == W_Q5_0 ? 16 : W == W_Q4_0 ? 8 : tabled && KQ_VNNI ? 128 : 0;
            const kvi isum = offset ? VSUB32(a[i], VSET32(offset * ((int)sp[0] + (int)sp[1]))) : a[i];
            acc[i] = VFMA(VCVT(isum), VMULF(d, VSETF(xd[(long)i * nb + b])), acc[i]);
            if (W == W_Q5_1) acc[i] = VFMA(mn, VSETF(xs[(long)i * nb + b]), acc[i]);
        }
    }
}

#else /* ---- the scalar dequantization of one packed row: GGUF's arithmetic in fp32 ---- */

/* Row j of a group's 32-weight blocks (Q5_0, Q4_0, Q5_1, IQ4_NL, MXFP4). */
static void kq_dequant_q32(const uint8_t *group, int wtype, int K, int j, float *out) {
    const int rec = wtype == W_Q5_0 ? REC_Q5_0 : wtype == W_Q5_1 ? REC_Q5_1 : wtype == W_IQ4_NL ? REC_IQ4_NL
                    : wtype == W_MXFP4 ? REC_MXFP4 : REC_Q4_0;
    const int qoff = wtype == W_Q5_0 ? 48 : wtype == W_Q5_1 ? 64 : wtype == W_MXFP4 ? 8 : 16;
    const int foff = wtype == W_Q5_0 ? 16 : 32;
    for (int b = 0; b < K / QK; ++b) {
        const uint8_t *r = group + (long)b * rec;
        const float d = wtype == W_MXFP4 ? kq_e8m0_half(r[j]) : kq_h2f(((const uint16_t *)r)[j]);
        for (int v = 0; v < QK; ++v) {
            const int h = v / 16, c = (v % 16) / 4, t = v % 4;
            const uint8_t byte = r[qoff + 32 * c + 4 * j + t], nib = h ? byte >> 4 : byte & 0x0F;
            const int fifth = (r[foff + 4 * j + t] >> (2 * c + h)) & 1;
            float w;
            if (wtype == W_Q5_0)
                w = d * (float)((nib | (fifth << 4)) - 16);
            else if (wtype == W_Q5_1)
                w = d * (float)(nib | (fifth << 4)) + kq_h2f(((const uint16_t *)(r + 16))[j]);
            else if (wtype == W_Q4_0)
                w = d * (float)(nib - 8);
            else if (wtype == W_MXFP4)
                w = d * (float)kq_mxfp4_values[nib];
            else
                w = d * (float)kq_iq4_values[nib];
            out[b * QK + v] = w;
        }
    }
}
#endif
