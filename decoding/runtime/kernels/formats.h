/* The weight formats, declared once for the C side: id (WeightType in decoding/runtime/formats/base.py), weights per
 * block, bytes per block in the file, bytes per packed record of 8 rows (one module per format in
 * decoding/runtime/formats says how a record is laid out). When a library loads, Python compares its registry with
 * this table (rs_format_sizes) and refuses a library that differs. The dispatch from a format to its kernel file
 * (matmul.c) is a switch over rs_wtype naming every format, no default (-Werror=switch: a format added here and not
 * dispatched does not compile); a kernel file's own switch names its formats and stops on any other
 * (rs_unknown_format): nothing ever computes one format with another's layout. */
#ifndef RS_FORMATS_H
#define RS_FORMATS_H
#include <stdint.h>

#define RS_FORMATS(X)                \
    X(Q8_0, 1, 32, 34, 272)          \
    X(Q4_1, 2, 32, 20, 160)          \
    X(Q4_K, 3, 256, 144, 1184)       \
    X(Q6_K, 4, 256, 210, 1680)       \
    X(Q5_0, 5, 32, 22, 176)          \
    X(Q4_0, 6, 32, 18, 144)          \
    X(Q5_1, 7, 32, 24, 192)          \
    X(IQ4_NL, 8, 32, 18, 144)        \
    X(IQ4_XS, 9, 256, 136, 1104)     \
    X(Q5_K, 10, 256, 176, 1440)      \
    X(F16, 11, 1, 2, 16)             \
    X(BF16, 12, 1, 2, 16)            \
    X(F32, 13, 1, 4, 32)             \
    X(Q2_K, 14, 256, 84, 672)        \
    X(Q3_K, 15, 256, 110, 912)       \
    X(MXFP4, 17, 32, 17, 136)

typedef enum {
#define RS_FORMAT_ID(name, id, weights, bytes, record) W_##name = id,
    RS_FORMATS(RS_FORMAT_ID)
#undef RS_FORMAT_ID
    W_PARTS = 16 /* rows of several formats one after the other (quant.py's join_rows): not a format */
} rs_wtype;

enum { /* REC_<format>: bytes of one packed record of 8 rows */
#define RS_FORMAT_RECORD(name, id, weights, bytes, record) REC_##name = record,
    RS_FORMATS(RS_FORMAT_RECORD)
#undef RS_FORMAT_RECORD
};

/* Each format file's entry points, called by matmul.c's dispatch (inside a parallel region: "parts"). */
void q8_q41_matmul_part(const int8_t *xq, const float *xd, const float *xs, int M, int K, const uint8_t *w, int wtype,
                        long ldg, int N, float *y, long ldy, const float *bias, const float *res, long ldr);
void q8_q41_dequant_row(const uint8_t *group, int wtype, int K, int j, float *out);
void kq_matmul_part(const float *x, long ldx, const int8_t *xq, const float *xd, const float *xs, int M, int K,
                    const uint8_t *w, int wtype, long ldg, int N, float *y, long ldy, const float *bias, const float *res,
                    long ldr);
void kq_dequant_row(const uint8_t *group, int wtype, int K, int j, float *out);
void fl_matmul_part(const float *x, long ldx, int M, int K, const uint8_t *w, int wtype, long ldg, int N, float *y,
                    long ldy, const float *bias, const float *res, long ldr);
void fl_dequant_row(const uint8_t *group, int wtype, long ldg, int K, int j, float *out);
/* matmul.c: y[M, N] = x @ w^T (+ bias) (+ res) in w's format (PARTS: each part in its own) */
void qmatmul_part(const float *x, long ldx, const int8_t *xq, const float *xd, const float *xs, int M, int K,
                  const uint8_t *w, int wtype, long ldg, int N, float *y, long ldy, const float *bias, const float *res,
                  long ldr);

/* Pairs of weight groups (two groups' records side by side on 512-bit vectors) or one group at a time, by the rows
   of a matrix product: entry M for M activation rows, the last (RS_PAIR_ROWS - 1) for that many or more. The two
   give the same bits (each output's operations are the same), so the choice is speed alone, and it differs between
   CPUs (a pair reads two streams of weights at once; a CPU that runs 512-bit vectors in two halves gains no
   arithmetic from them): the library starts with pairs from 5 rows, and Python sets what its measurement found
   (rs_pair_table). Read by every matrix product, written rarely: a forward running meanwhile may take either. */
#define RS_PAIR_ROWS 18
extern uint8_t rs_pairs_by_rows[RS_PAIR_ROWS];
static inline int rs_pairs(int M) { return rs_pairs_by_rows[M < RS_PAIR_ROWS - 1 ? M : RS_PAIR_ROWS - 1]; }

/* A format id no switch knows (never reached: Python only passes registered formats): stop loudly rather than
   compute with another format's layout. */
__attribute__((noreturn, cold)) void rs_unknown_format(int wtype);

#endif
