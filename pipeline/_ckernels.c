/* Fused int4/int8 quantise+pack and unpack+dequantise for tensor blobs (pipeline/kernels.py wraps it).
 *
 * SPEC section 6 and docs/formats.md "Tensor blobs": per-block absmax scale, round half to even, never
 * stochastic. This file computes exactly what pipeline/codec.py's numpy kernels compute, bit for bit,
 * in one pass over the values instead of about ten: every float operation is the same IEEE float32
 * operation in the same order (x / scale, then + MAGIC; (code - 8) * scale), so it must be built
 * without -ffast-math and with -ffp-contract=off (setup.py), or a multiply-add could be fused.
 *
 * Both entry points release the GIL while they run: the learner's sender encodes on a thread beside
 * the training loop (issue 15), and a pool of threads runs the codec's jobs side by side.
 * Buffers may be unaligned (a tensor's scales start wherever the previous tensor's codes end), so
 * every float access goes through a 1-aligned type.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <float.h>
#include <stdlib.h>

typedef float f32u __attribute__((aligned(1), may_alias));
typedef uint32_t u32u __attribute__((aligned(1), may_alias));

/* The two loops are compiled for several instruction sets and the best one the CPU has is picked
 * when the module loads (GCC's ifunc): x86-64's baseline SSE2 has no unsigned max or narrowing packs
 * and runs quantise 3-4x slower than AVX2 (docs/scale.md). IEEE float32 division, addition and
 * multiplication give the same bits in every instruction set, so every clone writes the same bytes. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(DDILOCO_NO_CLONES)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define INLINE static inline __attribute__((always_inline))   /* into each clone, compiled for its ISA */
#define CHUNK 256                      /* values per inner pass: temporaries stay in L1 */
#define MAGIC_BASE 12582912.0f         /* 1.5 * 2**23: y + MAGIC is MAGIC + rint(y), half to even */

/* Codes of n values (n even, n <= CHUNK) of one block with divisor d into 8-bit codes (the low
 * byte of (clip(x / d) + magic)'s bits). The clip matters only for subnormal scales; for a normal
 * scale |x / d| <= q (1 + 2**-23) rounds to q anyway (pipeline/codec.py _quantize_step). */
INLINE void codes_of(const f32u *restrict x, int n, float d, float q, float magic, uint8_t *restrict out)
{
    for (int i = 0; i < n; i++) {
        float t = x[i] / d;
        t = t < -q ? -q : t;
        t = t > q ? q : t;
        float y = t + magic;
        uint32_t b;
        memcpy(&b, &y, 4);
        out[i] = (uint8_t)b;
    }
}

/* The largest |x| bits a block may have for qmax: above it a value is NaN/Inf, or the scale is so
 * large that decoding the code qmax, qmax * scale, overflows float32 - absmax / qmax rounds up for
 * absmax near FLT_MAX (int8: 3.4028235e38 / 127 * 127 is inf) and the blob would decode to inf.
 * Found once, by the same float32 operations the blocks use; pipeline/codec.py's numpy path refuses
 * the same blocks (it checks qmax * scale itself). One compare per block, as for NaN/Inf alone. */
static uint32_t absmax_limit(int qmax)
{
    float q = (float)qmax;
    for (uint32_t b = 0x7F7FFFFFu;; b--) {
        float m;
        memcpy(&m, &b, 4);
        float s = m / q;
        if (s * q <= FLT_MAX)
            return b;
    }
}

static uint32_t limit7, limit127;           /* absmax_limit(7), absmax_limit(127): set at import */

/* One block of bs values at x into scale *sc and codes at c; 0 when its |x| bits exceed limit
 * (absmax_limit: NaN/Inf, or a scale whose qmax * scale is inf). */
INLINE int quantize_block(const f32u *restrict x, Py_ssize_t bs, int qmax, uint32_t limit, uint8_t *restrict sc,
                          uint8_t *restrict c)
{
    const u32u *bits = (const u32u *)x;
    uint32_t m = 0;
    for (Py_ssize_t i = 0; i < bs; i++) {   /* |x| as bits: their integer order is the float order */
        uint32_t a = bits[i] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    if (m > limit)                          /* NaN/Inf, or qmax * scale would overflow */
        return 0;
    float mf, q = (float)qmax;
    memcpy(&mf, &m, 4);
    float s = mf / q;
    memcpy(sc, &s, 4);
    float d = s > 0.0f ? s : 1.0f;          /* an all-zero block keeps scale 0 and codes 0 */
    float magic = MAGIC_BASE + (qmax == 7 ? 8.0f : 0.0f);
    uint8_t tmp[CHUNK];
    for (Py_ssize_t lo = 0; lo < bs; lo += CHUNK) {
        int n = (int)(bs - lo < CHUNK ? bs - lo : CHUNK);
        if (qmax == 127) {
            codes_of(x + lo, n, d, q, magic, c + lo);
            continue;
        }
        codes_of(x + lo, n, d, q, magic, tmp);
        uint8_t *dst = c + lo / 2;          /* value 2i in the low nibble of byte i */
        for (int i = 0; i < n / 2; i++)
            dst[i] = (uint8_t)(tmp[2 * i] | (tmp[2 * i + 1] << 4));
    }
    return 1;
}

/* n values at x (n <= nb * bs; the last block zero-padded) into nb scales and their codes. */
CLONES static int quantize_all(const f32u *x, Py_ssize_t n, Py_ssize_t bs, int qmax, uint8_t *scales,
                        uint8_t *codes, float *pad)
{
    Py_ssize_t full = n / bs, per = qmax == 7 ? bs / 2 : bs;
    uint32_t limit = qmax == 7 ? limit7 : limit127;
    for (Py_ssize_t b = 0; b < full; b++)
        if (!quantize_block(x + b * bs, bs, qmax, limit, scales + 4 * b, codes + b * per))
            return 0;
    if (full * bs < n) {
        Py_ssize_t rem = n - full * bs;
        memcpy(pad, (const void *)(x + full * bs), (size_t)rem * 4);
        memset(pad + rem, 0, (size_t)(bs - rem) * 4);
        if (!quantize_block((const f32u *)pad, bs, qmax, limit, scales + 4 * full, codes + full * per))
            return 0;
    }
    return 1;
}

/* One block's codes into n <= bs values; returns 1 for a code encode never writes. */
INLINE int dequantize_block(const uint8_t *restrict c, float s, Py_ssize_t n, Py_ssize_t bs, int qmax,
                            f32u *restrict out)
{
    int bad = 0;
    if (qmax == 127) {
        for (Py_ssize_t i = 0; i < bs; i++)
            bad |= c[i] == 0x80;
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = (float)(int8_t)c[i] * s;
        return bad;
    }
    for (Py_ssize_t i = 0; i < bs / 2; i++)
        bad |= (c[i] & 0x0F) == 0 || (c[i] & 0xF0) == 0;
    Py_ssize_t pairs = n / 2;
    for (Py_ssize_t i = 0; i < pairs; i++) {
        out[2 * i] = (float)((int)(c[i] & 0x0F) - 8) * s;
        out[2 * i + 1] = (float)((int)(c[i] >> 4) - 8) * s;
    }
    if (n % 2)
        out[n - 1] = (float)((int)(c[pairs] & 0x0F) - 8) * s;
    return bad;
}

CLONES static int dequantize_all(const uint8_t *scales, const uint8_t *codes, Py_ssize_t n, Py_ssize_t nb,
                          Py_ssize_t bs, int qmax, f32u *out)
{
    Py_ssize_t per = qmax == 7 ? bs / 2 : bs;
    int bad = 0;
    for (Py_ssize_t b = 0; b < nb; b++) {
        float s;
        memcpy(&s, scales + 4 * b, 4);
        Py_ssize_t k = n - b * bs < bs ? n - b * bs : bs;
        bad |= dequantize_block(codes + b * per, s, k, bs, qmax, out + b * bs);
    }
    return bad;
}

/* Shared argument checks: nb blocks for n values, and the scales' and codes' lengths. */
static int check_sizes(Py_ssize_t n, Py_ssize_t bs, int qmax, Py_ssize_t scales_len, Py_ssize_t codes_len,
                       Py_ssize_t *nb)
{
    if (qmax != 7 && qmax != 127) {
        PyErr_SetString(PyExc_ValueError, "qmax must be 7 (int4) or 127 (int8)");
        return 0;
    }
    if (bs < 2 || bs % 2) {
        PyErr_SetString(PyExc_ValueError, "block size must be even and >= 2");
        return 0;
    }
    *nb = (n + bs - 1) / bs;
    if (scales_len != 4 * *nb || codes_len != *nb * (qmax == 7 ? bs / 2 : bs)) {
        PyErr_Format(PyExc_ValueError, "buffers do not fit %zd values in blocks of %zd", n, bs);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(quantize_doc,
"quantize(x, scales, codes, qmax, block_size) -> bool\n\n"
"float32 values x (any buffer) into writable buffers of ceil(n / block_size) float32 scales and\n"
"their int4 (qmax 7) or int8 (qmax 127) codes, exactly as pipeline/codec.py's numpy path.\n"
"False if a value is NaN or Inf, or a block's qmax * scale overflows float32 (the outputs are\n"
"then partly written). Releases the GIL.");

static PyObject *py_quantize(PyObject *self, PyObject *args)
{
    Py_buffer x, sc, cd;
    int qmax;
    Py_ssize_t bs, nb;
    if (!PyArg_ParseTuple(args, "y*w*w*in", &x, &sc, &cd, &qmax, &bs))
        return NULL;
    PyObject *res = NULL;
    float *pad = NULL;
    Py_ssize_t n = x.len / 4;
    if (x.len % 4)
        PyErr_SetString(PyExc_ValueError, "x must hold float32 values");
    else if (check_sizes(n, bs, qmax, sc.len, cd.len, &nb)) {
        if (n % bs && !(pad = malloc((size_t)bs * 4)))
            PyErr_NoMemory();
        else {
            int ok;
            Py_BEGIN_ALLOW_THREADS
            ok = quantize_all((const f32u *)x.buf, n, bs, qmax, sc.buf, cd.buf, pad);
            Py_END_ALLOW_THREADS
            res = PyBool_FromLong(ok);
        }
    }
    free(pad);
    PyBuffer_Release(&x);
    PyBuffer_Release(&sc);
    PyBuffer_Release(&cd);
    return res;
}

PyDoc_STRVAR(dequantize_doc,
"dequantize(scales, codes, out, qmax, block_size) -> bool\n\n"
"The inverse: scales and codes into the writable float32 buffer out (n values, the last block's\n"
"padding dropped). False if a code is one encode never writes (int4 nibble 0, int8 -128), checked\n"
"over every block including the padding; scales are not checked here. Releases the GIL.");

static PyObject *py_dequantize(PyObject *self, PyObject *args)
{
    Py_buffer sc, cd, out;
    int qmax;
    Py_ssize_t bs, nb;
    if (!PyArg_ParseTuple(args, "y*y*w*in", &sc, &cd, &out, &qmax, &bs))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = out.len / 4;
    if (out.len % 4)
        PyErr_SetString(PyExc_ValueError, "out must hold float32 values");
    else if (check_sizes(n, bs, qmax, sc.len, cd.len, &nb)) {
        int bad;
        Py_BEGIN_ALLOW_THREADS
        bad = dequantize_all(sc.buf, cd.buf, n, nb, bs, qmax, (f32u *)out.buf);
        Py_END_ALLOW_THREADS
        res = PyBool_FromLong(!bad);
    }
    PyBuffer_Release(&sc);
    PyBuffer_Release(&cd);
    PyBuffer_Release(&out);
    return res;
}

static PyMethodDef methods[] = {
    {"quantize", py_quantize, METH_VARARGS, quantize_doc},
    {"dequantize", py_dequantize, METH_VARARGS, dequantize_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pipeline._ckernels",
    "Fused int4/int8 quantise and dequantise kernels (see pipeline/kernels.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__ckernels(void)
{
    limit7 = absmax_limit(7);
    limit127 = absmax_limit(127);
    return PyModule_Create(&module);
}
