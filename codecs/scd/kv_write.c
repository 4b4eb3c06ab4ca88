/* scd-store's native CPU kernels for an SCD decode, built and loaded by native.py, which checks
 * every shape, stride and index before calling.
 *
 * scd_write_kv, the last pass: token-major features (as the batched matmul produces them) written
 * into the KV cache, keys re-rotated (Llama "rotate half" RoPE), heads split. One pass over the
 * features instead of five PyTorch ops.
 *
 * features  [layers, 2, tokens, heads * head_dim] float32, contiguous (keys' features, then values')
 * cos, sin  [tokens, head_dim / 2] float32, contiguous: RoPE half tables at the tokens' positions
 * offset    [layers, 2, heads * head_dim] float32 added to the features first, or NULL
 * keys, values  element (layer 0, head 0, token 0) of the outputs; a token's head_dim floats are
 *           contiguous and the next token follows; layer_stride and head_stride are in floats.
 */
#include <stdint.h>
#include <string.h>

#define TOKEN_BLOCK 64

void scd_write_kv(const float *features, int64_t layers, int64_t tokens, int64_t heads, int64_t head_dim,
                  const float *cos, const float *sin, const float *offset, float *keys, float *values,
                  int64_t layer_stride, int64_t head_stride) {
    const int64_t half = head_dim / 2, width = heads * head_dim;
    const int64_t blocks = (tokens + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
    const int64_t items = layers * heads * blocks;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t layer = item / (heads * blocks), head = (item / blocks) % heads, block = item % blocks;
        const int64_t first = block * TOKEN_BLOCK;
        const int64_t last = first + TOKEN_BLOCK < tokens ? first + TOKEN_BLOCK : tokens;
        const float *key_in = features + 2 * layer * tokens * width + head * head_dim;
        const float *value_in = key_in + tokens * width;
        float *key_out = keys + layer * layer_stride + head * head_stride;
        float *value_out = values + layer * layer_stride + head * head_stride;
        if (offset) {
            const float *restrict key_bias = offset + 2 * layer * width + head * head_dim;
            const float *restrict value_bias = key_bias + width;
            for (int64_t t = first; t < last; t++) {
                const float *restrict x = key_in + t * width, *restrict y = value_in + t * width;
                const float *restrict c = cos + t * half, *restrict s = sin + t * half;
                float *restrict o = key_out + t * head_dim, *restrict v = value_out + t * head_dim;
                for (int64_t j = 0; j < half; j++) {
                    const float x1 = x[j] + key_bias[j], x2 = x[j + half] + key_bias[j + half];
                    o[j] = x1 * c[j] - x2 * s[j];
                    o[j + half] = x2 * c[j] + x1 * s[j];
                }
                for (int64_t j = 0; j < head_dim; j++) v[j] = y[j] + value_bias[j];
            }
            continue;
        }
        for (int64_t t = first; t < last; t++) {
            const float *restrict x = key_in + t * width;
            const float *restrict c = cos + t * half;
            const float *restrict s = sin + t * half;
            float *restrict o = key_out + t * head_dim;
            for (int64_t j = 0; j < half; j++) {
                const float x1 = x[j], x2 = x[j + half];
                o[j] = x1 * c[j] - x2 * s[j];
                o[j + half] = x2 * c[j] + x1 * s[j];
            }
            memcpy(value_out + t * head_dim, value_in + t * width, (size_t)head_dim * sizeof(float));
        }
    }
}

/* The decode's row gather: out [n, tokens] float32 = codes[rows[i], first:first + tokens] for
 * uint8 codes [R, stride] (storage order) and int64 rows [n] (checked in range by the caller). */
void scd_gather_codes(const uint8_t *codes, int64_t stride, const int64_t *rows, int64_t n, int64_t first,
                      int64_t tokens, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *restrict src = codes + rows[i] * stride + first;
        float *restrict dst = out + i * tokens;
        for (int64_t t = 0; t < tokens; t++) dst[t] = (float)src[t];
    }
}
