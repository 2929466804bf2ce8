/* The weight-format table's one entry point (formats.h) and the stop for an unknown format id. */
#include "api.h"
#include "formats.h"

#include <stdio.h>
#include <stdlib.h>

/* out[0..2] = a format's weights per block, bytes per block, bytes per packed record; 0, or -1 for an id that is not a
   format (Python's registry is checked against this at load). */
int rs_format_sizes(int wtype, int *out) {
    switch ((rs_wtype)wtype) {
#define RS_FORMAT_SIZES(name, id, weights, bytes, record) \
    case W_##name: out[0] = weights, out[1] = bytes, out[2] = record; return 0;
        RS_FORMATS(RS_FORMAT_SIZES)
#undef RS_FORMAT_SIZES
    case W_PARTS: return -1;
    }
    return -1;
}

uint8_t rs_pairs_by_rows[RS_PAIR_ROWS] = {0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

/* The pair choice's table (formats.h): set from set[0 .. n) where set is given (1: that many rows run pairs of
   groups; entry 0 unused), copied to got[0 .. n) where got is given; returns n, or 0 where this library has no pairs
   of groups (not AVX-512) and nothing is set or copied. */
int rs_pair_table(const uint8_t *set, uint8_t *got) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    for (int m = 1; set && m < RS_PAIR_ROWS; ++m) rs_pairs_by_rows[m] = set[m] ? 1 : 0;
    for (int m = 0; got && m < RS_PAIR_ROWS; ++m) got[m] = rs_pairs_by_rows[m];
    return RS_PAIR_ROWS;
#else
    (void)set, (void)got;
    return 0;
#endif
}

void rs_unknown_format(int wtype) {
    fprintf(stderr, "ragspec CPU kernels: weight format id %d is not one of formats.h's\n", wtype);
    abort();
}
