/* test_platform.c - platform.h's calls, in whichever form this build has:
 * Linux's own, or the POSIX fallbacks (`make portable` builds them here
 * with -DTANDEM_PORTABLE, as macOS gets them). */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <time.h>

#include "base/hugemap.h"
#include "base/platform.h"
#include "t.h"
#include "base/threadpool.h"

/* ==== Which form ==== */

static void check_name(void) {
#if defined(__linux__) && !defined(TANDEM_PORTABLE)
    const char *want = "linux";
#else
    const char *want = "posix";
#endif
    printf("platform calls: %s\n", plat_name());
    CHECK(!strcmp(plat_name(), want), "plat_name %s, expected %s", plat_name(), want);
}

/* ==== Random bytes ==== */

static void check_random(void) {
    /* 1000 bytes: several of getentropy's 256-byte calls */
    static uint8_t a[1000], b[1000];
    CHECK(plat_random(a, sizeof a, 0) == 0, "plat_random: %s", strerror(errno));
    CHECK(plat_random(b, sizeof b, 1) == 0, "plat_random nonblock: %s", strerror(errno));
    CHECK(memcmp(a, b, sizeof a) != 0, "two draws equal");
    /* every byte written: the last chunk's bytes differ from a fill */
    int zeros = 0, tail_same = 0;
    for (size_t i = 0; i < sizeof a; i++) zeros += a[i] == 0;
    for (size_t i = 744; i < sizeof a; i++) tail_same += a[i] == b[i];
    CHECK(zeros < 20, "%d zero bytes of 1000", zeros);
    CHECK(tail_same < 10, "the last 256 bytes of two draws agree in %d places", tail_same);
    CHECK(plat_random(a, 0, 0) == 0, "zero bytes");
}

/* ==== Waiting on a word ==== */

typedef struct {
    _Atomic uint32_t ping, pong;
    int rounds;
    atomic_int done;
} pingpong;

/* The other side of the ping-pong: waits for each ping, answers. */
static void *pp_thread(void *arg) {
    pingpong *p = arg;
    for (int r = 1; r <= p->rounds; r++) {
        uint32_t v;
        while ((v = atomic_load(&p->ping)) != (uint32_t)r) plat_wait(&p->ping, v);
        atomic_store(&p->pong, (uint32_t)r);
        plat_wake(&p->pong);
    }
    atomic_store(&p->done, 1);
    return NULL;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void check_wait(void) {
    /* a word that already differs: no sleep */
    _Atomic uint32_t w = 5;
    double t0 = now_s();
    plat_wait(&w, 4);
    CHECK(now_s() - t0 < 1.0, "plat_wait slept on a word that differed");
    plat_wake(&w);   /* nobody waiting: a no-op */

    /* 20000 round trips with no spinning: a wake lost between a waiter's
     * check and its sleep would stop them */
    pingpong p = { .rounds = 20000 };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, pp_thread, &p) == 0, "thread");
    t0 = now_s();
    int r = 1, stuck = 0;
    for (; r <= p.rounds && !stuck; r++) {
        atomic_store(&p.ping, (uint32_t)r);
        plat_wake(&p.ping);
        uint32_t v;
        while ((v = atomic_load(&p.pong)) != (uint32_t)r) {
            if (now_s() - t0 > 60) { stuck = 1; break; }
            plat_wait(&p.pong, v);
        }
    }
    CHECK(!stuck, "ping-pong stuck at round %d of %d", r, p.rounds);
    if (stuck) { fprintf(stderr, "(the waiting thread is left behind)\n"); return; }
    pthread_join(th, NULL);
    CHECK(atomic_load(&p.done) == 1, "ping-pong finished");
    printf("  %d wait/wake round trips in %.2f s\n", p.rounds, now_s() - t0);

    /* the thread pool on top of them */
    tpool *pool = tpool_create(3);
    CHECK(pool != NULL, "pool");
    if (pool) tpool_destroy(pool);
}

/* ==== Sockets ==== */

static int fd_cloexec(int fd) { int f = fcntl(fd, F_GETFD); return f >= 0 && (f & FD_CLOEXEC); }
static int fd_nonblock(int fd) { int f = fcntl(fd, F_GETFL); return f >= 0 && (f & O_NONBLOCK); }

static void check_sockets(void) {
    int s0 = plat_socket(AF_INET, SOCK_STREAM, 0, 0), s1 = plat_socket(AF_INET, SOCK_STREAM, 0, 1);
    CHECK(s0 >= 0 && s1 >= 0, "plat_socket: %s", strerror(errno));
    CHECK(fd_cloexec(s0) && fd_cloexec(s1), "sockets close on exec");
    CHECK(!fd_nonblock(s0) && fd_nonblock(s1), "non-blocking only when asked");
    close(s1);
    errno = 0;
    CHECK(plat_socket(-1, SOCK_STREAM, 0, 0) == -1 && errno != 0, "a bad family fails with errno");

    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t al = sizeof a;
    CHECK(!bind(s0, (struct sockaddr *)&a, sizeof a) && !listen(s0, 4) &&
          !getsockname(s0, (struct sockaddr *)&a, &al), "listen on loopback: %s", strerror(errno));
    for (int nb = 0; nb < 2; nb++) {
        int c = plat_socket(AF_INET, SOCK_STREAM, 0, 0);
        CHECK(c >= 0 && !connect(c, (struct sockaddr *)&a, sizeof a), "connect: %s", strerror(errno));
        int s = plat_accept(s0, nb);
        CHECK(s >= 0, "plat_accept: %s", strerror(errno));
        if (s < 0) { close(c); continue; }
        CHECK(fd_cloexec(s), "accepted socket closes on exec");
        CHECK(fd_nonblock(s) == nb, "accepted socket non-blocking %d, asked %d", fd_nonblock(s), nb);
        /* a write to a closed peer: EPIPE, not SIGPIPE (which would end this
         * process under the default action) */
        close(c);
        signal(SIGPIPE, SIG_DFL);
        ssize_t w = 0;
        for (int i = 0; i < 50 && w >= 0; i++) {
            w = send(s, "x", 1, PLAT_MSG_NOSIGNAL);
            usleep(2000);
        }
        CHECK(w < 0 && (errno == EPIPE || errno == ECONNRESET), "write to a closed peer: %zd (%s)", w, strerror(errno));
        close(s);
    }
    close(s0);
}

/* ==== Memory ==== */

static void check_memory(void) {
    uint64_t avail = plat_mem_available();
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    uint64_t phys = pages > 0 && size > 0 ? (uint64_t)pages * (uint64_t)size : 0;
    printf("  available memory: %.1f of %.1f GiB\n", avail / 1073741824.0, phys / 1073741824.0);
#if defined(__linux__)
    CHECK(avail > 0, "no available memory reported");   /* both forms know it on Linux */
#endif
    CHECK(phys == 0 || avail <= phys, "available %llu > physical %llu", (unsigned long long)avail,
          (unsigned long long)phys);
}

/* Pages of this process's mapping [p, p + n pages) that are resident in its
 * own page tables: /proc/self/pagemap's present bit (Linux); -1 elsewhere. */
static int map_resident_pages(const uint8_t *p, int n, long pg) {
#if defined(__linux__)
    int fd = open("/proc/self/pagemap", O_RDONLY);
    if (fd < 0) return -1;
    int count = 0;
    for (int i = 0; i < n; i++) {
        uint64_t e = 0;
        if (pread(fd, &e, 8, (off_t)(((uintptr_t)p / (uintptr_t)pg + (uintptr_t)i) * 8)) != 8) { count = -1; break; }
        count += (int)(e >> 63);
    }
    close(fd);
    return count;
#else
    (void)p; (void)n; (void)pg;
    return -1;
#endif
}

/* plat_map_drop on a read-only file mapping: the whole pages inside the
 * range leave the resident set (where the system says which are), the
 * partial ones at its edges stay, and every byte reads back the same. */
static void check_map_drop(void) {
    long pg = sysconf(_SC_PAGESIZE);
    char path[] = "/tmp/test_platform_map_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0 && pg > 0, "mkstemp: %s", strerror(errno));
    if (fd < 0 || pg <= 0) return;
    unlink(path);
    enum { NPG = 8 };
    size_t n = (size_t)pg * NPG;
    uint8_t *want = malloc(n);
    for (size_t i = 0; want && i < n; i++) want[i] = (uint8_t)(i * 131 + i / 4096);
    int ok = want && write(fd, want, n) == (ssize_t)n;
    CHECK(ok, "write: %s", strerror(errno));
    const uint8_t *m = ok ? mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
    close(fd);
    if (m == MAP_FAILED) { free(want); CHECK(0, "mmap: %s", strerror(errno)); return; }
    for (size_t i = 0; i < n; i += (size_t)pg) (void)*(const volatile uint8_t *)(m + i);   /* touch each page */
    int before = map_resident_pages(m, NPG, pg);
    /* from the middle of page 1 to the middle of page 6: pages 2..5 go */
    plat_map_drop(m + pg + pg / 2, (size_t)pg * 5);
    int after = map_resident_pages(m, NPG, pg);
    printf("  map drop: %d resident pages of %d before, %d after\n", before, NPG, after);
    if (before >= 0) {
        CHECK(before == NPG, "%d of %d touched pages resident", before, NPG);
        CHECK(after == NPG - 4, "%d pages resident after dropping 4 of %d", after, NPG);
        CHECK(map_resident_pages(m + pg, 1, pg) == 1 && map_resident_pages(m + 6 * pg, 1, pg) == 1,
              "a partially covered page left");
    }
    CHECK(memcmp(m, want, n) == 0, "contents changed after plat_map_drop");
    plat_map_drop(m, 0);   /* nothing, not an error */
    munmap((void *)m, n);
    free(want);
}

/* hugemap_trim: the bytes before `used` are kept, the pages past it leave
 * the resident set (where the system says which are) and read as zeros. */
static void check_hugemap_trim(void) {
    long pg = sysconf(_SC_PAGESIZE);
    size_t mapped = 0, used = 2 * HUGEMAP_PAGE + 100;   /* into the third huge page */
    uint8_t *p = hugemap_alloc(5 * HUGEMAP_PAGE, &mapped);
    CHECK(p && mapped == 5 * HUGEMAP_PAGE && pg > 0, "hugemap_alloc: %p, %zu bytes", (void *)p, mapped);
    if (!p || pg <= 0) return;
    for (size_t i = 0; i < 4 * HUGEMAP_PAGE; i++) p[i] = (uint8_t)(i * 7 + 1);   /* past used too */
    hugemap_trim(p, mapped, used);
    size_t lo = (used + (size_t)pg - 1) / (size_t)pg;   /* first page past used */
    int kept = map_resident_pages(p, (int)lo, pg);
    int left = map_resident_pages(p + lo * (size_t)pg, (int)(mapped / (size_t)pg - lo), pg);
    printf("  hugemap trim: %d of %zu pages before used resident, %d after\n", kept, lo, left);
    if (kept >= 0) {
        CHECK(kept == (int)lo, "%d of the %zu pages before used resident", kept, lo);
        CHECK(left == 0, "%d pages past used still resident", left);
    }
    size_t bad = 0;
    for (size_t i = 0; i < used; i++) bad += p[i] != (uint8_t)(i * 7 + 1);
    for (size_t i = used; i < mapped; i++) bad += p[i] != 0;
    CHECK(bad == 0, "%zu bytes wrong after hugemap_trim", bad);
    hugemap_trim(p, mapped, mapped);   /* nothing to give back: no change */
    CHECK(p[0] == 1 && p[mapped - 1] == 0, "a full trim changed bytes");
    hugemap_free(p, mapped);
}

int main(void) {
    check_name();
    check_random();
    check_wait();
    check_sockets();
    check_memory();
    check_map_drop();
    check_hugemap_trim();
    return t_done("platform");
}
