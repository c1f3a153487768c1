/* What the fused weight-only matmul extensions for a CPU share (_int4_cpu.c,
 * _int8_cpu.c): the run-time choice among the builds of a file's row loop, the split
 * of W's rows across threads, the check of a buffer's size, and `paths()`.
 *
 * A file includes it after its `Job` type (whose fields n, n0 and n1 are W's row
 * count and the rows [n0, n1) one job computes), its row loops rows_avx512 and
 * rows_avx2 (x86-64 SIMD builds, under HAVE_X86_SIMD) and rows_portable, and
 * MAX_THREADS; having defined MIN_GROUP_AVX512, MIN_GROUP_AVX2 and
 * MIN_GROUP_PORTABLE, the group width (a multiple of it) each build needs.
 * A file with a second family of builds (another table of `Path`s over the same
 * `Job`) picks among them with `pick_in` and names them with `names_in`.
 */
#ifndef RELEASEGATE_CPU_PATHS_H
#define RELEASEGATE_CPU_PATHS_H

typedef void (*RowsFn)(const Job *);

/* The builds this CPU runs, best first; `min_group` is the group width (a multiple of
 * it) each needs. */
typedef struct {
    const char *name;
    RowsFn fn;
    Py_ssize_t min_group;
    int (*runs)(void);
} Path;

static int always(void) { return 1; }
#ifdef HAVE_X86_SIMD
static int has_avx512(void) { return __builtin_cpu_supports("avx512f"); }
static int has_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

static const Path PATHS[] = {
#ifdef HAVE_X86_SIMD
    {"avx512", rows_avx512, MIN_GROUP_AVX512, has_avx512},
    {"avx2", rows_avx2, MIN_GROUP_AVX2, has_avx2},
#endif
    {"portable", rows_portable, MIN_GROUP_PORTABLE, always},
};
#define N_PATHS ((Py_ssize_t)(sizeof(PATHS) / sizeof(PATHS[0])))

typedef struct {
    RowsFn fn;
    const Job *job;
} Task;

static void *run_task(void *task) {
    const Task *t = task;
    t->fn(t->job);
    return NULL;
}

/* The path named `name` in `table` (`count` entries; NULL name: the best this CPU
 * runs for `group`), or NULL with a ValueError set. */
static const Path *pick_in(const Path *table, Py_ssize_t count, const char *name,
                           Py_ssize_t group) {
    for (Py_ssize_t i = 0; i < count; i++) {
        const Path *p = &table[i];
        if (name && strcmp(name, p->name)) continue;
        if (p->runs() && group % p->min_group == 0) return p;
        if (name && !p->runs())
            PyErr_Format(PyExc_ValueError, "path %s does not run on this CPU", name);
        else if (name)
            PyErr_Format(PyExc_ValueError, "path %s needs a group that is a multiple of %zd, "
                         "got group=%zd", name, p->min_group, group);
        if (name) return NULL;
    }
    PyErr_Format(PyExc_ValueError, "no path named %s", name ? name : "(none)");
    return NULL;
}

static const Path *pick(const char *name, Py_ssize_t group) {
    return pick_in(PATHS, N_PATHS, name, group);
}

/* Checks a buffer holds exactly `count` items of `itemsize` bytes. */
static int sized(const Py_buffer *b, const char *name, Py_ssize_t count, Py_ssize_t itemsize) {
    if (b->len != count * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd (%zd items of %zd)",
                     name, b->len, count * itemsize, count, itemsize);
        return 0;
    }
    return 1;
}

/* Runs `path` over W's rows split into `threads` (1..MAX_THREADS, at most job->n)
 * shares, each a copy of `job` with its own [n0, n1), with the GIL released: the
 * first share on this thread, and one whose thread can't start here too. */
static void run_split(const Path *path, const Job *job, Py_ssize_t threads) {
    const Py_ssize_t n = job->n;
    if (threads > n) threads = n;
    Job jobs[MAX_THREADS];
    Task tasks[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < threads; t++) {
        jobs[t] = *job;
        jobs[t].n0 = n * t / threads;
        jobs[t].n1 = n * (t + 1) / threads;
        tasks[t] = (Task){path->fn, &jobs[t]};
        if (t > 0 && pthread_create(&ids[t], NULL, run_task, &tasks[t]) == 0) started[t] = 1;
    }
    for (Py_ssize_t t = 0; t < threads; t++)
        if (!started[t]) path->fn(&jobs[t]);
    for (Py_ssize_t t = 1; t < threads; t++)
        if (started[t]) pthread_join(ids[t], NULL);
    Py_END_ALLOW_THREADS
}

/* The names of the builds in `table` this CPU runs, best first, as a tuple. */
static PyObject *names_in(const Path *table, Py_ssize_t count) {
    PyObject *names = PyList_New(0);
    for (Py_ssize_t i = 0; names && i < count; i++)
        if (table[i].runs()) {
            PyObject *name = PyUnicode_FromString(table[i].name);
            if (!name || PyList_Append(names, name) < 0) Py_CLEAR(names);
            Py_XDECREF(name);
        }
    if (!names) return NULL;
    PyObject *result = PyList_AsTuple(names);
    Py_DECREF(names);
    return result;
}

/* paths() -> the names of the builds this CPU runs, best first */
static PyObject *paths(PyObject *self, PyObject *unused) { return names_in(PATHS, N_PATHS); }

#define PATHS_METHOD                                                                     \
    {"paths", paths, METH_NOARGS, "paths() -> names of the builds this CPU runs, best first"}

#endif
