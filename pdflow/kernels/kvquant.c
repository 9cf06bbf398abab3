/* Integer KV codecs' encode and decode (pdflow/kv/codecs/quantized.py says what the bytes mean;
 * this computes the same bytes, one pass over the values instead of PyTorch's ten).
 *
 * A call handles n blocks of `tokens` tokens x `channels` fp32 channels (token-major), each
 * encoded into `stride` bytes at out + i * stride: codes (bits 8: one byte, bits 4: two per byte,
 * even channel low), then float16 scales, then float16 minimums (asymmetric). Keys: a scale per
 * channel per `group` tokens (scales [token groups][channels]); values: a scale per `group`
 * channels of each token (scales [tokens][channels / group]). Symmetric codes are
 * round(x / scale) in [-top, top] (int4 stored + 8); asymmetric round((x - minimum) / scale) in
 * [0, 2^bits - 1], computed against the float16-rounded scale and minimum. Rounding is to nearest,
 * ties to even (the default mode, as torch.round). Returns 0, or -1 if x held a NaN or a scale or
 * minimum is not finite in float16 (nothing is then to be trusted in out).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pdflow_kernels.h"

/* float16 <-> float32, round to nearest even (as torch's .half()) */
static uint16_t to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0));  /* inf, nan */
    if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* rounds past 65504: inf */
    if (x < 0x38800000u) {  /* below float16's smallest normal: a subnormal (or zero) */
        if (x < 0x33000000u) return (uint16_t)sign;
        const uint32_t mant = (x & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)(x >> 23);  /* 14 + 113 - exponent - 1 */
        uint32_t half = mant >> (shift), rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((x >> 13) - (112u << 10));
    const uint32_t rest = x & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half++;
    return (uint16_t)(sign | half);
}

static float from_half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mant = h & 0x3ffu, x;
    if (exponent == 0) {
        if (mant == 0) x = sign;
        else {  /* subnormal: normalize */
            exponent = 113;
            while (!(mant & 0x400u)) { mant <<= 1; exponent--; }
            x = sign | (exponent << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exponent == 31) x = sign | 0x7f800000u | (mant << 13);
    else x = sign | ((exponent + 112u) << 23) | (mant << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* the codes of one row of `count` values: (x - minimum[c]) * inverse[c], or with one minimum and
 * inverse for all when per_channel is 0; computed as floats first (a loop the compiler
 * vectorizes), then stored or packed. Returns nonzero if x held a NaN (which every comparison lets
 * through, so no range saw it) */
static int code_row(const float *x, int64_t count, const float *minimum, const float *inverse, int per_channel,
                     int symmetric, int bits, float top, uint8_t *codes) {
    const float low_code = symmetric ? -top : 0.0f;
    float q[8192];
    if (per_channel && symmetric)
        for (int64_t c = 0; c < count; c++) q[c] = clampf(nearbyintf(x[c] * inverse[c]), low_code, top);
    else if (per_channel)
        for (int64_t c = 0; c < count; c++) q[c] = clampf(nearbyintf((x[c] - minimum[c]) * inverse[c]), low_code, top);
    else {
        const float m = symmetric ? 0.0f : minimum[0], inv = inverse[0];
        for (int64_t c = 0; c < count; c++) q[c] = clampf(nearbyintf((x[c] - m) * inv), low_code, top);
    }
    int nan = 0;
    for (int64_t c = 0; c < count; c++) nan |= q[c] != q[c];
    if (nan) return 1;
    if (bits == 8) {
        if (symmetric) for (int64_t c = 0; c < count; c++) codes[c] = (uint8_t)(int8_t)q[c];
        else for (int64_t c = 0; c < count; c++) codes[c] = (uint8_t)q[c];
        return 0;
    }
    const float shift = symmetric ? 8.0f : 0.0f;
    for (int64_t c = 0; c < count; c += 2)
        codes[c / 2] = (uint8_t)(q[c] + shift) | (uint8_t)((uint8_t)(q[c + 1] + shift) << 4);
    return 0;
}

/* the smallest and largest of x[0 .. count): eight running lanes (a loop the compiler vectorizes,
 * which a single running minimum is not without -ffast-math), then the lanes */
static void range_of(const float *x, int64_t count, float *lo_out, float *hi_out) {
    float lo[8], hi[8];
    int64_t c = 0;
    if (count >= 8) {
        for (int j = 0; j < 8; j++) lo[j] = hi[j] = x[j];
        for (c = 8; c + 8 <= count; c += 8)
            for (int j = 0; j < 8; j++) {
                lo[j] = x[c + j] < lo[j] ? x[c + j] : lo[j];
                hi[j] = x[c + j] > hi[j] ? x[c + j] : hi[j];
            }
    } else
        for (int j = 0; j < 8; j++) lo[j] = hi[j] = x[0];
    float l = lo[0], h = hi[0];
    for (int j = 1; j < 8; j++) {
        l = lo[j] < l ? lo[j] : l;
        h = hi[j] > h ? hi[j] : h;
    }
    for (; c < count; c++) {
        l = x[c] < l ? x[c] : l;
        h = x[c] > h ? x[c] : h;
    }
    *lo_out = l;
    *hi_out = h;
}

int pdflow_kv_encode(const float *x, int64_t n, int64_t tokens, int64_t channels, int keys, int64_t group, int bits,
                     int symmetric, uint8_t *out, int64_t stride) {
    const float top = symmetric ? (float)((1 << (bits - 1)) - 1) : (float)((1 << bits) - 1);
    const int64_t code_bytes = tokens * channels * bits / 8;
    const int64_t scales = keys ? (tokens + group - 1) / group * channels : tokens * (channels / group);
    float lo[8192], hi[8192], inverse[8192];  /* channels <= 8192 (checked by the caller) */
    int bad = 0;
    for (int64_t b = 0; b < n; b++) {
        const float *xb = x + b * tokens * channels;
        uint8_t *codes = out + b * stride, *scale_out = codes + code_bytes, *min_out = scale_out + 2 * scales;
        if (keys) {
            for (int64_t t0 = 0, s = 0; t0 < tokens; t0 += group, s++) {
                const int64_t t1 = t0 + group < tokens ? t0 + group : tokens;
                for (int64_t c = 0; c < channels; c++) lo[c] = hi[c] = xb[t0 * channels + c];
                for (int64_t t = t0 + 1; t < t1; t++)
                    for (int64_t c = 0; c < channels; c++) {
                        const float v = xb[t * channels + c];
                        lo[c] = v < lo[c] ? v : lo[c];
                        hi[c] = v > hi[c] ? v : hi[c];
                    }
                for (int64_t c = 0; c < channels; c++) {
                    uint16_t sh, mh = 0;
                    if (symmetric) {
                        const float amax = fmaxf(fabsf(lo[c]), fabsf(hi[c]));
                        sh = to_half(amax / top);
                    } else {
                        mh = to_half(lo[c]);
                        sh = to_half((hi[c] - from_half(mh)) / top);
                        memcpy(min_out + 2 * (s * channels + c), &mh, 2);
                        lo[c] = from_half(mh);
                    }
                    memcpy(scale_out + 2 * (s * channels + c), &sh, 2);
                    const float sf = from_half(sh);
                    bad |= !isfinite(sf) || (!symmetric && !isfinite(lo[c]));
                    inverse[c] = sf > 0.0f ? 1.0f / sf : 0.0f;
                }
                for (int64_t t = t0; t < t1; t++)
                    bad |= code_row(xb + t * channels, channels, lo, inverse, 1, symmetric, bits, top,
                             codes + t * channels * bits / 8);
            }
        } else {
            const int64_t per_token = channels / group;
            for (int64_t t = 0; t < tokens; t++)
                for (int64_t g = 0; g < per_token; g++) {
                    const float *xg = xb + t * channels + g * group;
                    float l, h;
                    range_of(xg, group, &l, &h);
                    const int64_t at = t * per_token + g;
                    uint16_t sh, mh = 0;
                    float minimum = 0.0f;
                    if (symmetric) sh = to_half(fmaxf(fabsf(l), fabsf(h)) / top);
                    else {
                        mh = to_half(l);
                        minimum = from_half(mh);
                        sh = to_half((h - minimum) / top);
                        memcpy(min_out + 2 * at, &mh, 2);
                    }
                    memcpy(scale_out + 2 * at, &sh, 2);
                    const float sf = from_half(sh);
                    bad |= !isfinite(sf) || !isfinite(minimum);
                    const float inv = sf > 0.0f ? 1.0f / sf : 0.0f;
                    bad |= code_row(xg, group, &minimum, &inv, 0, symmetric, bits, top, codes + (t * channels + g * group) * bits / 8);
                }
        }
    }
    return bad ? -1 : 0;
}

void pdflow_kv_decode(const uint8_t *data, int64_t stride, int64_t n, int64_t tokens, int64_t channels, int keys,
                      int64_t group, int bits, int symmetric, float *out) {
    const int64_t code_bytes = tokens * channels * bits / 8;
    const int64_t scales = keys ? (tokens + group - 1) / group * channels : tokens * (channels / group);
    const float shift = bits == 4 && symmetric ? 8.0f : 0.0f;
    float scale[8192], minimum[8192], row[8192];
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *codes = data + b * stride, *scale_in = codes + code_bytes, *min_in = scale_in + 2 * scales;
        float *ob = out + b * tokens * channels;
        for (int64_t t = 0; t < tokens; t++) {
            const uint8_t *ct = codes + t * channels * bits / 8;
            if (bits == 8) {
                if (symmetric) for (int64_t c = 0; c < channels; c++) row[c] = (float)(int8_t)ct[c];
                else for (int64_t c = 0; c < channels; c++) row[c] = (float)ct[c];
            } else
                for (int64_t i = 0; i < channels / 2; i++) {
                    row[2 * i] = (float)(ct[i] & 15) - shift;
                    row[2 * i + 1] = (float)(ct[i] >> 4) - shift;
                }
            if (keys) {
                if (t % group == 0) {  /* this token group's scales (and minimums) */
                    const int64_t s = t / group * channels;
                    for (int64_t c = 0; c < channels; c++) {
                        uint16_t h;
                        memcpy(&h, scale_in + 2 * (s + c), 2);
                        scale[c] = from_half(h);
                        if (!symmetric) {
                            memcpy(&h, min_in + 2 * (s + c), 2);
                            minimum[c] = from_half(h);
                        }
                    }
                }
                float *o = ob + t * channels;
                if (symmetric) for (int64_t c = 0; c < channels; c++) o[c] = row[c] * scale[c];
                else for (int64_t c = 0; c < channels; c++) { const float v = row[c] * scale[c]; o[c] = v + minimum[c]; }
            } else {
                const int64_t per_token = channels / group;
                for (int64_t g = 0; g < per_token; g++) {
                    uint16_t h;
                    memcpy(&h, scale_in + 2 * (t * per_token + g), 2);
                    const float s = from_half(h);
                    float m = 0.0f;
                    if (!symmetric) {
                        memcpy(&h, min_in + 2 * (t * per_token + g), 2);
                        m = from_half(h);
                    }
                    float *o = ob + t * channels + g * group;
                    const float *r = row + g * group;
                    for (int64_t c = 0; c < group; c++) { const float v = r[c] * s; o[c] = v + m; }
                }
            }
        }
    }
}
