/* kvxfer.device._sums: the fingerprint sums (P, L, H) of runs of 32-bit words in one pass.

   The same values as kvxfer.device.fingerprint.word_sums's numpy path, which reads the
   words three times (two einsums and an XOR) and so costs about twice what D's
   verification cost before the three-word fingerprint; this loop reads each word
   once and the compiler vectorizes it. Loaded with ctypes (kvxfer.device.fingerprint);
   the module object exists only so that setuptools builds and installs it like
   any extension. All strides are in 32-bit words. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__linux__) && defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define KVXFER_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef KVXFER_CLONES
#define KVXFER_CLONES
#endif

/* Row (s, u) of `words` holds `m` words at words + rows[s] * s_stride + u * u_stride
   (rows NULL: s itself), weighted by weights + u * w_stride; its sums go to
   out + s * out_s + u * out_u (P, L, H). */
KVXFER_CLONES
void kvxfer_word_sums(const uint32_t *words, const int64_t *rows, ptrdiff_t s_stride,
                      ptrdiff_t u_stride, size_t num_s, size_t num_u,
                      const uint32_t *weights, ptrdiff_t w_stride, size_t m,
                      uint32_t *out, ptrdiff_t out_s, ptrdiff_t out_u) {
  for (size_t s = 0; s < num_s; s++) {
    const uint32_t *row = words + (rows ? rows[s] : (int64_t)s) * s_stride;
    for (size_t u = 0; u < num_u; u++) {
      const uint32_t *w = row + u * u_stride, *c = weights + u * w_stride;
      uint32_t p = 0, l = 0, h = 0;
      for (size_t j = 0; j < m; j++) {
        uint32_t x = w[j];
        p ^= x;
        l += c[j] * (x & 0xFFFFu);
        h += c[j] * (x >> 16);
      }
      uint32_t *o = out + s * out_s + u * out_u;
      o[0] = p;
      o[1] = l;
      o[2] = h;
    }
  }
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sums",
                                    "kvxfer's one-pass fingerprint sums (loaded with ctypes).", -1};

PyMODINIT_FUNC PyInit__sums(void) { return PyModule_Create(&module); }
