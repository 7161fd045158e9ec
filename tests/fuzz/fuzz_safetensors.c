/*
 * fuzz_safetensors.c - libFuzzer target for the model-file parsers: the
 * safetensors header and, inside an accepted file, every bitsandbytes quant
 * state (its JSON and the parts it names). Whatever the bytes, the parsers
 * must refuse or accept without reading outside the file, and an accepted
 * 4-bit weight must dequantize within its buffers (AddressSanitizer checks).
 *
 * Built with clang by scripts/test.sh (-DQL_FUZZ=ON) and run for a bounded
 * time from the seed corpus in tests/fixtures.
 */
#include "fuzz_input.h"
#include "modelfile.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define QS_MARK ".quant_state.bitsandbytes__"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_input_file(data, size, "safetensors");
    if (!path)
        return 0;

    st_file st;
    char msg[512];
    if (st_open(&st, path, msg, sizeof msg) != QL_OK)
        return 0;
    for (size_t i = 0; i < st.n_tensors; i++) {
        const char *mark = strstr(st.tensors[i].name, QS_MARK);
        if (!mark)
            continue;
        char base[512];
        snprintf(base, sizeof base, "%.*s", (int)(mark - st.tensors[i].name), st.tensors[i].name);
        qtensor t;
        if (bnb_read(&st, base, &t, NULL, msg, sizeof msg) != QL_OK)
            continue;
        /* bounded work per input: dequantize the first rows only */
        int64_t rows = t.rows < 4 ? t.rows : 4;
        if (t.cols <= (1 << 20)) {
            float *out = malloc((size_t)(rows * t.cols) * sizeof *out);
            if (out)
                qt_dequantize_rows(&t, 0, rows, out);
            free(out);
        }
        qt_free(&t);
    }
    st_close(&st);
    return 0;
}
