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

void rs_unknown_format(int wtype) {
    fprintf(stderr, "ragspec CPU kernels: weight format id %d is not one of formats.h's\n", wtype);
    abort();
}
