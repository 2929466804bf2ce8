/* The vector layer of formats_int.c's template body, per KQ_LANES: 8 lanes (one group of 8 weight rows, 256-bit)
 * or 16 (two groups side by side, 512-bit). Included twice per width: first defines the layer, then (KQ_LANES_SET
 * defined) undefines it. */
#ifndef KQ_LANES_SET
#define KQ_LANES_SET
#if KQ_LANES == 16
#define KQ(name) name##_16
#define KQ_MB 6 /* activation rows per tile (more spill a format's per-row registers) */
#define kvi __m512i
#define kvf __m512
#define VZERO() _mm512_setzero_si512()
#define VZEROF() _mm512_setzero_ps()
#define V8(c) _mm512_set1_epi8((char)(c))
#define VAND _mm512_and_si512
#define VOR _mm512_or_si512
#define VSRL16 _mm512_srli_epi16
#define VSLL16 _mm512_slli_epi16
#define VSLL32 _mm512_slli_epi32
#define VSRL32 _mm512_srli_epi32
#define VSRA32 _mm512_srai_epi32
#define VADD32 _mm512_add_epi32
#define VSUB32 _mm512_sub_epi32
#define VMULLO32 _mm512_mullo_epi32
#define VMADD16 _mm512_madd_epi16
#define VDOT(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#define VSET32(v) _mm512_set1_epi32(v)
#define VSETF _mm512_set1_ps
#define VCVT _mm512_cvtepi32_ps
#define VFMA _mm512_fmadd_ps
#define VFNMA _mm512_fnmadd_ps
#define VMULF _mm512_mul_ps
#define VSHUF _mm512_shuffle_epi8
/* a chunk of two groups: 32 bytes of each side by side */
static inline kvi KQ(ld)(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
static inline kvf KQ(f16)(const uint8_t *a, const uint8_t *b) { /* 8 fp16 of each group */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}
static inline kvi KQ(u8x8)(const uint8_t *a, const uint8_t *b) { /* 8 bytes of each group -> int32 lanes */
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}
static inline kvi KQ(i8x8)(const uint8_t *a, const uint8_t *b) { /* 8 signed bytes of each group -> int32 lanes */
    return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}
static inline kvi KQ(i8x16)(const uint8_t *a, const uint8_t *b) { /* 16 bytes of each group -> int16 lanes */
    return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                        _mm_loadu_si128((const __m128i *)b), 1));
}
static inline kvi KQ(bc4)(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
}
#define G1(p) (p) /* the second group's pointer */
#else
#define KQ(name) name##_8
#define KQ_MB 6 /* AVX2's 16 registers spill a few accumulators: still faster than reading the weights again */
#define kvi __m256i
#define kvf __m256
#define VZERO() _mm256_setzero_si256()
#define VZEROF() _mm256_setzero_ps()
#define V8(c) _mm256_set1_epi8((char)(c))
#define VAND _mm256_and_si256
#define VOR _mm256_or_si256
#define VSRL16 _mm256_srli_epi16
#define VSLL16 _mm256_slli_epi16
#define VSLL32 _mm256_slli_epi32
#define VSRL32 _mm256_srli_epi32
#define VSRA32 _mm256_srai_epi32
#define VADD32 _mm256_add_epi32
#define VSUB32 _mm256_sub_epi32
#define VMULLO32 _mm256_mullo_epi32
#define VMADD16 _mm256_madd_epi16
#if KQ_VNNI
#define VDOT(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#endif
#define VSET32(v) _mm256_set1_epi32(v)
#define VSETF _mm256_set1_ps
#define VCVT _mm256_cvtepi32_ps
#define VFMA _mm256_fmadd_ps
#define VFNMA _mm256_fnmadd_ps
#define VMULF _mm256_mul_ps
#define VSHUF _mm256_shuffle_epi8
static inline kvi KQ(ld)(const uint8_t *a, const uint8_t *b) {
    (void)b;
    return _mm256_loadu_si256((const __m256i *)a);
}
static inline kvf KQ(f16)(const uint8_t *a, const uint8_t *b) {
    (void)b;
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a));
}
static inline kvi KQ(u8x8)(const uint8_t *a, const uint8_t *b) {
    (void)b;
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)a));
}
static inline kvi KQ(i8x8)(const uint8_t *a, const uint8_t *b) {
    (void)b;
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)a));
}
static inline kvi KQ(i8x16)(const uint8_t *a, const uint8_t *b) {
    (void)b;
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)a));
}
static inline kvi KQ(bc4)(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}
#define G1(p) ((void)(p), (const uint8_t *)0)
#endif
#else
#undef KQ_LANES_SET
#undef KQ
#undef KQ_MB
#undef kvi
#undef kvf
#undef VZERO
#undef VZEROF
#undef V8
#undef VAND
#undef VOR
#undef VSRL16
#undef VSLL16
#undef VSLL32
#undef VSRL32
#undef VSRA32
#undef VADD32
#undef VSUB32
#undef VMULLO32
#undef VMADD16
#undef VDOT
#undef VSET32
#undef VSETF
#undef VCVT
#undef VFMA
#undef VFNMA
#undef VMULF
#undef VSHUF
#undef G1
#endif
