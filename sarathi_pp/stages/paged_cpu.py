"""A small C kernel for decode attention on CPU that reads K/V from the paged cache in place.

Why (see Note [paged decode on CPU]): the portable path copies every decode's whole context
out of the paged cache into a contiguous buffer and then runs SDPA over it, so a decode step
reads the context twice and writes it once. This kernel walks each sequence's block table
and reads every K and V row once, where it lies: for each sequence (one per thread at a time,
taken from a shared counter, so mixed context lengths balance), scores for all heads, an
exact softmax over the whole context, then the weighted sum of V.

Built on first use with the system C compiler (``cc``; ~0.5 s) into the user's cache
(``~/.cache/sarathi_pp/kernels``, or ``$SARATHI_PP_KERNEL_DIR``) and loaded with ctypes: no
torch headers, no build step at install time. float32 only. Where no compiler works, or
``SARATHI_PP_CPU_KERNEL=0``, ``load_kernel`` returns None and attention keeps the portable
gather + SDPA path.

Note [paged decode on CPU]: 32 decodes x 1k context, one layer of the embedded model (16
heads, 4 KV heads, head_dim 64; 67 MB of K/V), 2 threads: gather + SDPA 46-56 ms, gather in
groups of 4 sequences (kept in cache) + SDPA ~20 ms, this kernel 12-15 ms (scores 5-9, softmax
~1.5 with a vectorised exp, weighted V ~4), on a shared 2-core EPYC (load ~2).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

/* Below this many multiply-adds per thread a thread costs more than it saves (and on a busy
   machine a started thread may wait a whole time slice for a core). */
#define MIN_WORK_PER_THREAD (1 << 20)

typedef struct {
    const float *q, *k, *v;
    const int64_t *tables, *lens;
    int64_t table_stride;
    float *out;
    int num_seqs, heads, kv_heads, head_dim, block_size, max_len, next;
    float scale;
} job_t;

/* exp(x) for x <= 0 (a score minus the row's max): Cephes' expf polynomial, ~1 ulp, and
   unlike libm's expf it vectorises. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    union { int32_t i; float f; } u = {.i = ((int32_t)n + 127) << 23};
    return y * u.f;
}

static inline void prefetch(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i);  /* 16 floats: a line */
}

/* One sequence: q [H, D] against its n cached tokens. s: [H, n] scratch. D is a literal at
   the call sites below, so the inner loops unroll into vector registers. */
static inline __attribute__((always_inline)) void one_seq(const job_t *j, int b, float *s,
                                                          const int D) {
    const int H = j->heads, G = j->heads / j->kv_heads, BS = j->block_size;
    const int64_t n = j->lens[b], row = (int64_t)j->kv_heads * D;  /* floats per slot */
    const int64_t *table = j->tables + b * j->table_stride;
    const float *q = j->q + (int64_t)b * H * D;
    for (int64_t t0 = 0; t0 < n; t0 += BS) {  /* scores, block by block */
        const float *kb = j->k + table[t0 / BS] * BS * row;
        const int64_t m = n - t0 < BS ? n - t0 : BS;
        if (t0 + BS < n) prefetch(j->k + table[t0 / BS + 1] * BS * row, BS * row);
        for (int h = 0; h < H; h++) {
            const float *qh = q + h * D, *kh = kb + (h / G) * D;
            for (int64_t i = 0; i < m; i++) {
                float acc = 0.f;
                #pragma omp simd reduction(+:acc)
                for (int x = 0; x < D; x++) acc += qh[x] * kh[i * row + x];
                s[h * n + t0 + i] = acc * j->scale;
            }
        }
    }
    for (int h = 0; h < H; h++) {  /* softmax over the whole context */
        float *sh = s + h * n, mx = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; t++) mx = sh[t] > mx ? sh[t] : mx;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < n; t++) { sh[t] = exp_nonpos(sh[t] - mx); sum += sh[t]; }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int64_t t = 0; t < n; t++) sh[t] *= inv;
    }
    float *o = j->out + (int64_t)b * H * D;
    for (int h = 0; h < H; h++) {  /* weighted sum of V, head by head (acc in registers) */
        float a[D];
        for (int x = 0; x < D; x++) a[x] = 0.f;
        const float *sh = s + h * n;
        for (int64_t t0 = 0; t0 < n; t0 += BS) {
            const float *vh = j->v + table[t0 / BS] * BS * row + (h / G) * D;
            const int64_t m = n - t0 < BS ? n - t0 : BS;
            if (h == 0 && t0 + BS < n) prefetch(j->v + table[t0 / BS + 1] * BS * row, BS * row);
            for (int64_t i = 0; i < m; i++) {
                const float p = sh[t0 + i];
                #pragma omp simd
                for (int x = 0; x < D; x++) a[x] += p * vh[i * row + x];
            }
        }
        for (int x = 0; x < D; x++) o[h * D + x] = a[x];
    }
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    float *s = malloc(sizeof(float) * (size_t)j->heads * (size_t)j->max_len);
    if (s == NULL) return (void *)1;
    for (;;) {
        int b = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (b >= j->num_seqs) break;
        if (j->head_dim == 64) one_seq(j, b, s, 64);
        else if (j->head_dim == 128) one_seq(j, b, s, 128);
        else one_seq(j, b, s, j->head_dim);
    }
    free(s);
    return NULL;
}

/* Returns 0, or 1 when scratch memory could not be allocated. */
int paged_decode_f32(const float *q, const float *k, const float *v, const int64_t *tables,
                     int64_t table_stride, const int64_t *lens, float *out, int num_seqs,
                     int heads, int kv_heads, int head_dim, int block_size, float scale,
                     int num_threads) {
    job_t j = {q, k, v, tables, lens, table_stride, out, num_seqs, heads, kv_heads, head_dim,
               block_size, 1, 0, scale};
    int64_t work = 0;  /* multiply-adds of the scores: split only work worth a thread */
    for (int b = 0; b < num_seqs; b++) {
        if (lens[b] > j.max_len) j.max_len = (int)lens[b];
        work += lens[b] * heads * head_dim;
    }
    if (num_threads > 1 + work / MIN_WORK_PER_THREAD) num_threads = 1 + work / MIN_WORK_PER_THREAD;
    if (num_threads > num_seqs) num_threads = num_seqs;
    if (num_threads > 64) num_threads = 64;
    if (num_threads < 1) num_threads = 1;
    pthread_t threads[64];
    int started = 1, failed = 0;
    for (; started < num_threads; started++)
        if (pthread_create(&threads[started], NULL, worker, &j) != 0) break;
    failed |= worker(&j) != NULL;
    for (int i = 1; i < started; i++) {
        void *r;
        pthread_join(threads[i], &r);
        failed |= r != NULL;
    }
    return failed;
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC"]


def _kernel_dir() -> Path:
    env = os.environ.get("SARATHI_PP_KERNEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "sarathi_pp" / "kernels"


def _compile(path: Path) -> None:
    """Build the library at ``path`` (atomically: stage actors may build it at once)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / "paged_decode.c", Path(tmp) / path.name
        src.write_text(_SOURCE)
        cmd = [compiler, *_FLAGS, str(src), "-o", str(lib), "-pthread"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
        os.replace(lib, path)


def _cpu_signature() -> str:
    """What ``-march=native`` compiled for: the library is keyed by it, so a home directory
    shared by machines with different CPUs never loads another CPU's build."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return platform.machine() + "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


@cache
def load_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The compiled ``paged_decode_f32``, or None (no compiler, or disabled by
    ``SARATHI_PP_CPU_KERNEL=0``); the reason is logged once."""
    if os.environ.get("SARATHI_PP_CPU_KERNEL", "1") == "0":
        return None
    key = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + _cpu_signature()).encode()).hexdigest()
    path = _kernel_dir() / f"paged_decode-{key[:16]}.so"
    try:
        if not path.exists():
            _compile(path)
        fn = ctypes.CDLL(str(path)).paged_decode_f32
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("CPU paged attention kernel unavailable, using gather + SDPA: %s", e)
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int64, ptr, ptr, i32, i32, i32, i32, i32]
    fn.argtypes += [ctypes.c_float, i32]
    fn.restype = i32
    return fn


def kernel_supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32


def paged_decode(
    q: torch.Tensor,  # [num_seqs, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    context_lens: torch.Tensor,  # [num_seqs] int64: keys each query attends to (its pos + 1)
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [num_seqs, heads, head_dim]
    """Attention of one query row per sequence over its paged context, read in place."""
    fn = load_kernel()
    assert fn is not None, "paged_decode needs the compiled kernel (load_kernel())"
    num_seqs, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim
    assert heads % kv_heads == 0 and block_tables.dtype == context_lens.dtype == torch.int64
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    out = torch.empty_like(q)
    failed = fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), out.data_ptr(), num_seqs, heads, kv_heads,
        head_dim, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("paged_decode: could not allocate the kernel's score buffers")
    return out
